"""Muon's matrices moved to the chips that own them across slices, and their updates back.

Over several slices the optimizer splits a Muon matrix's state and update over data x
slice (`state_layout.update_specs`), but Polar Express needs whole matrices. A stack of
n same-shaped matrices is therefore owned slice by slice (slice s the s-th n/S of them)
and, inside a slice, chip by chip: `to_owners` sends each chip's rows of the matrices
another slice owns there (one all-to-all across slices) and then gathers the owned rows
into whole matrices inside the slice; `from_owners` undoes it for the updates (rows
split inside the slice, then one all-gather across slices of each chip's rows). Only a
chip's own rows cross slices, never the zero matrices that pad a slice's stack to its
chips. Written out as collectives because the compiler, given the two layouts, moved
more across slices than the chip's rows (docs/pods.md).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from bov_jax.parallel import sharding

REPLICAS = ("slice", "data")  # the axes the moves run over by hand; fsdp, tensor: the compiler's
OWNER_AXES = ("slice", "data", "fsdp", "tensor")


def _sizes():
  mesh = jax.sharding.get_abstract_mesh()
  return mesh, mesh.shape["slice"], math.prod(mesh.shape[a] for a in sharding.IN_SLICE)


def owner_spec() -> P:
  """The owners' layout of a stack: its matrices split over every chip, slices outermost."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in OWNER_AXES if mesh.shape[a] > 1)
  return P(axes or None, None, None)


def slots(n: int) -> list[int | None]:
  """Which of n matrices each place of the owners' stack holds (None: a zero matrix):
  slice s the matrices s * ceil(n / S) onwards, padded to a multiple of its chips."""
  _, s, chips = _sizes()
  per = -(-n // s)
  places = -(-per // chips) * chips
  out = []
  for i in range(s):
    mine = [j for j in range(i * per, (i + 1) * per) if j < n]
    out += mine + [None] * (places - len(mine))
  return out


def _row_dim(u_spec: P) -> tuple[int, tuple]:
  """(the dimension of a matrix split over the replicas, those axes in their order)."""
  for i, e in enumerate(u_spec):
    axes = tuple(a for a in sharding.axes_of(e) if a in REPLICAS)
    if "slice" in axes:
      return i, axes
  raise ValueError(f"{u_spec} splits nothing across slices")


def _manual(u_spec: P) -> P:
  entries = [tuple(a for a in sharding.axes_of(e) if a in REPLICAS) or None for e in u_spec]
  return P(None, *entries)


def to_owners(stack, u_spec: P):
  """stack [n, m, k], each matrix laid out as `u_spec` -> the owners' stack
  [len(slots(n)), m, k] in `owner_spec()`."""
  mesh, s, chips = _sizes()
  n = stack.shape[0]
  per, places = -(-n // s), len(slots(n)) // s
  r, axes = _row_dim(u_spec)
  if per * s > n:  # slices own equal counts: zero matrices at the end (sent, but rare)
    stack = jax.numpy.concatenate([stack, jax.numpy.zeros((per * s - n, *stack.shape[1:]),
                                                          stack.dtype)])

  def move(x):  # [per * s, rows / (data * slice), k]: this chip's rows of every matrix
    x = jax.lax.all_to_all(x, "slice", 0, 1 + r, tiled=True)  # my slice's matrices, my rows
    x = jax.numpy.concatenate([x, jax.numpy.zeros((places - per, *x.shape[1:]), x.dtype)])
    if "data" in axes:  # whole rows, matrices split over the slice's data chips
      x = jax.lax.all_to_all(x, "data", 0, 1 + r, tiled=True)
    return x

  out = jax.shard_map(move, mesh=mesh, in_specs=_manual(u_spec),
                      out_specs=P(("slice", "data"), None, None), axis_names=set(REPLICAS),
                      check_vma=False)(stack)
  return jax.lax.with_sharding_constraint(out, owner_spec())


def from_owners(owned, u_spec: P, n: int):
  """The owners' stack (`to_owners`) -> [n, m, k], rows split over `data` as `u_spec`
  says, the same on every slice."""
  mesh, s, chips = _sizes()
  per = -(-n // s)
  r, axes = _row_dim(u_spec)

  def move(x):  # [places / data, m, k]: whole matrices of this chip's own
    if "data" in axes:
      x = jax.lax.all_to_all(x, "data", 1 + r, 0, tiled=True)  # my rows of my slice's
    return jax.lax.all_gather(x[:per], "slice", axis=0, tiled=True)  # and of every slice's

  rows = [None, None, None]
  rows[1 + r] = "data" if "data" in axes else None
  out = jax.shard_map(move, mesh=mesh, in_specs=P(("slice", "data"), None, None),
                      out_specs=P(*rows), axis_names=set(REPLICAS), check_vma=False)(owned)
  return out[:n]
