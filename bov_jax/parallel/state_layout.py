"""Where the optimizer's state lives and where its update runs, as PartitionSpecs: each
state leaf laid out like the parameter it copies, and, over data replicas, every
parameter's share of the update (ZeRO-1: `update_specs`). The rules for the parameters
themselves are sharding.py's."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from bov_jax.parallel import sharding


def like_params(tree, param_specs, param_shapes):
  """PartitionSpecs for a tree holding copies of the parameters (optimizer state).

  A leaf whose path ends in a parameter's path takes that parameter's spec on
  every dimension of equal size (Muon's per-row statistics keep the split of
  the dimension they share); anything else (step counters) is replicated.
  """
  specs = {sharding.path_keys(p): s for p, s in
           jax.tree_util.tree_leaves_with_path(param_specs, is_leaf=lambda x: isinstance(x, P))}
  shapes = {sharding.path_keys(p): s for p, s in jax.tree_util.tree_leaves_with_path(param_shapes)}

  def f(path, leaf):
    keys = sharding.path_keys(path)
    for start in range(len(keys)):
      if keys[start:] in specs:
        spec, shape = specs[keys[start:]], shapes[keys[start:]].shape
        if len(shape) != len(leaf.shape):
          return P()
        entries = list(spec) + [None] * (len(shape) - len(spec))
        return P(*[e if a == b else None for e, a, b in zip(entries, leaf.shape, shape)])
    return P()

  return jax.tree_util.tree_map_with_path(f, tree)


def update_specs(param_specs, params, mesh, across_slices=None):
  """The layout the optimizer keeps its state in and computes its update in, as
  PartitionSpecs like `param_specs`: over data replicas, each parameter's own spec with
  `data` added as the major split of the first dimension it divides (ZeRO-1; MaxText's
  `shard_optimizer_over_data`), so every replica updates a 1/data share; a parameter
  that no dimension of divides (a scalar) keeps its spec and is updated whole.

  Over several slices, a parameter for which `across_slices(path keys)` holds is split
  over `data` x `slice` instead (`slice` minor: a chip's share is a part of its slice's
  share), on its smallest dimension that divides: its share is reduce-scattered across
  slices too, and its update runs once over all slices (optim.muon); the others repeat
  in every slice."""
  data, slices = mesh.shape["data"], mesh.shape.get("slice", 1)
  if data * slices == 1:
    return param_specs

  def f(path, spec, x):
    entries = list(spec) + [None] * (len(x.shape) - len(spec))
    split = ("data", "slice") if slices > 1 and across_slices and across_slices(
        sharding.path_keys(path)) else ("data",)
    for reps in ((split, ("data",)) if len(split) > 1 else (split,)):
      reps = tuple(a for a in reps if mesh.shape[a] > 1)
      # across slices the smaller dimension first: a matrix's rows as Muon stacks it
      # (a tall one transposed), so a stack's members all split alike
      order = (sorted(range(len(entries)), key=lambda i: x.shape[i]) if "slice" in reps
               else range(len(entries)))
      for i in order:
        entry, n = entries[i], x.shape[i]
        axes = sharding.axes_of(entry)
        if reps and "data" not in axes and n % math.prod(
            mesh.shape[a] for a in reps + axes) == 0:
          entries[i] = reps + axes if len(reps + axes) > 1 else reps[0]
          return P(*entries)
    return spec

  return jax.tree_util.tree_map_with_path(f, param_specs, params,
                                          is_leaf=lambda x: isinstance(x, P))


def slice_split(spec: P) -> bool:
  """Whether a spec of `update_specs` splits its parameter's share across slices."""
  return any("slice" in sharding.axes_of(e) for e in spec)


def data_dim(spec: P) -> int:
  """The dimension a spec splits over the replicas (`data`, or `data` x `slice`), or -1
  (a tree leaf, where None is not)."""
  return next((i for i, e in enumerate(spec) if {"data", "slice"} & set(sharding.axes_of(e))),
              -1)


class UpdateLayout:
  """Where the optimizer works: each parameter's PartitionSpec and its update's
  (`update_specs`), looked up by the parameter's path (optim.muon's stacks)."""

  def __init__(self, param_specs, update_specs):
    leaves = lambda t: jax.tree_util.tree_leaves_with_path(t, is_leaf=lambda x: isinstance(x, P))
    self.update_specs = update_specs
    self._specs = {sharding.path_keys(path): (p, u) for (path, p), (_, u) in
                   zip(leaves(param_specs), leaves(update_specs))}

  def specs(self, path) -> tuple[P, P]:
    return self._specs[sharding.path_keys(path)]


def optimizer_specs(tx, params, param_specs):
  """(the optimizer state's abstract tree, its PartitionSpecs): the state `tx.init`
  makes for `params` (arrays or abstract), laid out like the parameters it copies."""
  abstract = jax.eval_shape(tx.init, params)
  return abstract, like_params(abstract, param_specs, params)


def bytes_per_device(tree, specs, mesh_sizes: dict) -> int:
  """Bytes one device holds of a (possibly abstract) tree under the given specs."""
  total = 0
  leaves = jax.tree_util.tree_leaves(tree)
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
  for x, spec in zip(leaves, spec_leaves):
    n = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    for entry in spec:
      axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
      n //= math.prod(mesh_sizes[a] for a in axes)
    total += n
  return total
