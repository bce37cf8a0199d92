"""The paper's optimizer (Table 6; the reference's optim.py): Muon for block matrices,
AdamW groups for the rest.

optax's `contrib.muon` is a different Muon (no variance reduction, other
coefficients, no cautious weight decay), so the reference's is written here as
an optax GradientTransformation; the groups are combined with `optax.partition`.
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from bov_jax.kernels import polar
from bov_jax.parallel import owners
from bov_jax.parallel import sharding
from bov_jax.parallel import state_layout

MUON_BETA2 = 0.9

# group -> (betas, weight decay); learning rates come from `hyperparams`.
ADAM_GROUPS = {
    "unembed": ((0.8, 0.96), 0.01),
    "embed": ((0.8, 0.995), 0.001),
    "smear": ((0.8, 0.95), 0.0),
    "alpha": ((0.8, 0.95), 0.05),
    "beta_gamma": ((0.96, 0.95), 0.0),
    "table": ((0.8, 0.995), 0.01),
}


# -- schedules (step `it` from 0; jnp so they trace) ----------------------------

def lr_multiplier(it, n, warmup=40, warmdown_ratio=0.65, final_frac=0.05):
  # a host integer (the loop's log line) is computed by numpy: no device op to compile
  xp = np if isinstance(it, (int, np.integer)) else jnp
  w = round(warmdown_ratio * n)
  it = xp.asarray(it, xp.float32)
  p = (n - it) / max(w, 1)
  return xp.where(it < warmup, (it + 1) / warmup,
                  xp.where(it <= n - w, 1.0, p + (1 - p) * final_frac))


def muon_momentum(it, n, warmdown_ratio=0.65):
  """0.85 -> 0.97 over the first 400 steps, then 0.97 -> 0.90 over the warmdown. The
  reference tests the warmup first, so in a run shorter than ~1,150 steps, where the two
  overlap, the warmup wins."""
  w = round(warmdown_ratio * n)
  it = jnp.asarray(it, jnp.float32)
  frac = (it - (n - w)) / max(w, 1)
  down = jnp.where(it >= n - w, 0.97 + (0.90 - 0.97) * frac, 0.97)
  return jnp.where(it < 400, 0.85 + (0.97 - 0.85) * it / 400.0, down)


def muon_weight_decay(it, n, wd):
  return wd * 0.5 * (1 + jnp.cos(jnp.pi * jnp.asarray(it, jnp.float32) / n))


# -- Muon ------------------------------------------------------------------------

class MuonState(NamedTuple):
  count: jnp.ndarray
  momentum: Any
  second: Any


def _reduce_axis(shape) -> int:
  """Our weights are [fan_in, fan_out]. Variance is averaged over the smaller
  dimension; for a square matrix over fan_in, giving one entry per output unit."""
  fan_in, fan_out = shape
  return 0 if fan_out >= fan_in else 1


def _second_shape(shape):
  axis = _reduce_axis(shape)
  return (1, shape[1]) if axis == 0 else (shape[0], 1)


def _transposed(spec: P) -> P:
  """The PartitionSpec of a matrix's transpose."""
  return P(*reversed(tuple(spec) + (None,) * (2 - len(spec))))


def muon_direction(g, buf, buf2, momentum, polar_dtype=jnp.float32, polar_gram=True):
  """One matrix's Muon direction and new buffers: momentum (no bias correction), Polar
  Express, then variance reduction rescaled to the same Frobenius norm."""
  u, buf = muon_momentum_step(g, buf, momentum)
  x, buf2 = orthogonalise(u, buf2, polar_dtype, polar_gram)
  return x, buf, buf2


def muon_momentum_step(g, buf, momentum):
  """(Nesterov-style input u, new momentum buffer), elementwise."""
  g = g.astype(jnp.float32)
  buf = momentum * buf + (1 - momentum) * g
  return (1 - momentum) * g + momentum * buf, buf


def orthogonalise(u, buf2, polar_dtype=jnp.float32, polar_gram=True):
  """Polar Express of u, then variance reduction with the second-moment buffer buf2,
  rescaled to the same Frobenius norm: (direction, new buf2)."""
  x = polar.polar_express(u, polar_dtype, polar_gram)
  axis = _reduce_axis(x.shape)
  n_red = x.shape[axis]
  v = jnp.mean(x * x, axis=axis, keepdims=True)
  buf2 = MUON_BETA2 * buf2 + (1 - MUON_BETA2) * v
  step = jax.lax.rsqrt(jnp.maximum(buf2, 1e-10))
  norm = jnp.sqrt(jnp.sum(v) * n_red)
  new_norm = jnp.sqrt(jnp.sum(v * n_red * step * step))
  x = x * step * (norm / jnp.maximum(new_norm, 1e-10))
  return x, buf2


def muon(learning_rate, momentum, weight_decay, batched: bool = True,
         polar_dtype=jnp.float32, polar_gram: bool = True,
         update_dtype=jnp.float32, layout=None) -> optax.GradientTransformation:
  """The reference's Muon. learning_rate, momentum, weight_decay: step -> value.

  batched: matrices of one shape go through Polar Express together, one
  batched matmul per step (optim.muon_batched).
  polar_dtype, polar_gram: see `kernels.polar.polar_express`.
  update_dtype: the final update lr*X + lr*wd*p*mask is computed in this dtype (the
  reference: bfloat16 under bfloat16 compute, X, lr, wd and p cast first).
  layout: a `state_layout.UpdateLayout` (optim.shard_optimizer). On a mesh of several
  devices the matrices of one shape and layout are then stacked, the stack padded with
  zero matrices to a multiple of the devices and split over them
  (`sharding.RULES["stack"]`): each device orthogonalises and updates whole matrices of
  its own, none repeats another's, and the updates go back to the parameters' layout
  in one collective per stack (nanochat's distributed Muon). Over several slices, where
  the layout splits a stack's state across slices too, each slice takes its part of the
  stack (parallel/owners.py) and none repeats another slice's.
  """
  direction = functools.partial(muon_direction, polar_dtype=polar_dtype, polar_gram=polar_gram)
  ortho = functools.partial(orthogonalise, polar_dtype=polar_dtype, polar_gram=polar_gram)

  def apply(x, p, lr_eff, wd):
    """The update of one matrix from its direction x (cautious weight decay), in
    update_dtype (the caller casts it to the parameter's)."""
    pf = p.astype(jnp.float32)
    mask = (x * pf >= 0)  # cautious: decay only where it agrees
    lr_u, wd_u = (jnp.asarray(v, update_dtype) for v in (lr_eff, wd))
    x_u, p_u = x.astype(update_dtype), pf.astype(update_dtype)
    return -(lr_u * x_u + lr_u * wd_u * p_u * mask.astype(update_dtype))

  def split_over_devices(paths, gs, bufs, bufs2, ps, lr, m, wd, n_shards):
    """Every matrix's update and buffers, the work split over the devices: the matrices
    of one shape and layout stacked (a tall one transposed: its direction is the
    transpose of its transpose's, variance reduction included, so each MLP's two
    matrices share a stack and pad it once), the stack split over the devices."""
    n = len(gs)
    upd, new_bufs, new_bufs2 = [None] * n, [None] * n, [None] * n
    groups = {}
    for k, g in enumerate(gs):
      tall = g.shape[0] > g.shape[1]
      as_wide = lambda spec: _transposed(spec) if tall else spec
      p_spec, u_spec = map(as_wide, layout.specs(paths[k]))
      groups.setdefault((g.shape[::-1] if tall else g.shape, p_spec), []).append((k, tall, u_spec))
    for (_, p_spec), members in groups.items():
      u_specs = {u_spec for _, _, u_spec in members}  # where the momentum step leaves them
      u_spec = u_specs.pop() if len(u_specs) == 1 else None
      members = [(k, tall) for k, tall, _ in members]
      if u_spec is not None and state_layout.slice_split(u_spec):
        across_slices(members, u_spec, p_spec, gs, bufs, bufs2, ps, lr, m, wd,
                      upd, new_bufs, new_bufs2)
        continue
      pad = -len(members) % n_shards
      wide = lambda x, tall: x.T if tall else x

      def stack(xs, spec=None):  # stacked where each matrix is, then split by matrices
        xs = jnp.stack(xs + [jnp.zeros_like(xs[0])] * pad)
        if spec is not None:
          xs = jax.lax.with_sharding_constraint(xs, P(None, *spec))
        return sharding.constrain(xs, ("stack", None, None))

      us = []
      for k, tall in members:
        u, new_bufs[k] = muon_momentum_step(gs[k], bufs[k], m)
        us.append(wide(u, tall))
      x, b2 = jax.vmap(ortho)(stack(us, u_spec),
                              stack([wide(bufs2[k], tall) for k, tall in members]))
      lr_eff = jnp.stack([lr * math.sqrt(max(1.0, gs[k].shape[1] / gs[k].shape[0]))
                          for k, _ in members] + [lr] * pad)
      u = jax.vmap(apply, in_axes=(0, 0, 0, None))(
          x, stack([wide(ps[k], tall) for k, tall in members], p_spec), lr_eff, wd)
      u = jax.lax.with_sharding_constraint(u.astype(ps[members[0][0]].dtype), P(None, *p_spec))
      for j, (k, tall) in enumerate(members):
        upd[k], new_bufs2[k] = wide(u[j], tall), wide(b2[j], tall)
    return upd, new_bufs, new_bufs2

  def across_slices(members, u_spec, p_spec, gs, bufs, bufs2, ps, lr, m, wd,
                    upd, new_bufs, new_bufs2):
    """split_over_devices for a stack whose state is split across slices as well: each
    slice orthogonalises its own part of the stack (parallel/owners.py), so no slice
    repeats another's; the updates travel back in update_dtype."""
    wide = lambda x, tall: x.T if tall else x  # noqa: E731
    us = []
    for k, tall in members:
      u, new_bufs[k] = muon_momentum_step(gs[k], bufs[k], m)
      us.append(wide(u, tall))
    places = owners.slots(len(members))

    def arrange(xs, spec):  # one per member -> the owners' stack, zero matrices where none
      zero = jnp.zeros_like(xs[0])
      xs = jax.lax.with_sharding_constraint(
          jnp.stack([zero if j is None else xs[j] for j in places]), P(None, *spec))
      return jax.lax.with_sharding_constraint(xs, owners.owner_spec())

    stacked = jax.lax.with_sharding_constraint(jnp.stack(us), P(None, *u_spec))
    x, b2 = jax.vmap(ortho)(owners.to_owners(stacked, u_spec),
                            arrange([wide(bufs2[k], tall) for k, tall in members], P()))
    lr_eff = jnp.stack([lr if j is None else lr * math.sqrt(max(
        1.0, gs[members[j][0]].shape[1] / gs[members[j][0]].shape[0])) for j in places])
    u = jax.vmap(apply, in_axes=(0, 0, 0, None))(
        x, arrange([wide(ps[k], tall) for k, tall in members], p_spec), lr_eff, wd)
    u = owners.from_owners(u, u_spec, len(members))
    for j, (k, tall) in enumerate(members):
      upd[k] = jax.lax.with_sharding_constraint(wide(u[j], tall).astype(ps[k].dtype),
                                                _transposed(p_spec) if tall else p_spec)
      new_bufs2[k] = wide(b2[places.index(j)], tall)

  def one_device(gs, bufs, bufs2, ps, lr, m, wd):
    """Every matrix's update and buffers on this device (stacked by shape when batched)."""
    groups = {}
    for k, g in enumerate(gs):
      groups.setdefault(tuple(g.shape) if batched else k, []).append(k)
    upd, new_bufs, new_bufs2 = [None] * len(gs), [None] * len(gs), [None] * len(gs)
    for ks in groups.values():
      fan_in, fan_out = gs[ks[0]].shape
      lr_eff = lr * math.sqrt(max(1.0, fan_out / fan_in))
      if len(ks) == 1:  # no stacking (a copy) for a matrix on its own
        outs = [direction(gs[ks[0]], bufs[ks[0]], bufs2[ks[0]], m)]
      else:
        stacked = jax.vmap(direction, in_axes=(0, 0, 0, None))(
            jnp.stack([gs[k] for k in ks]), jnp.stack([bufs[k] for k in ks]),
            jnp.stack([bufs2[k] for k in ks]), m)
        outs = [tuple(a[j] for a in stacked) for j in range(len(ks))]
      for k, (x, b, b2) in zip(ks, outs):
        new_bufs[k], new_bufs2[k] = b, b2
        upd[k] = apply(x, ps[k], lr_eff, wd).astype(ps[k].dtype)
    return upd, new_bufs, new_bufs2

  def init(params):
    return MuonState(
        count=jnp.zeros([], jnp.int32),
        momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        second=jax.tree.map(lambda p: jnp.zeros(_second_shape(p.shape), jnp.float32), params))

  def update(grads, state, params):
    if params is None:
      raise ValueError("muon needs params (cautious weight decay)")
    it = state.count
    lr, m, wd = learning_rate(it), momentum(it), weight_decay(it)
    paths_g, treedef = jax.tree_util.tree_flatten_with_path(grads)
    g_leaves = [g for _, g in paths_g]
    b_leaves = treedef.flatten_up_to(state.momentum)
    s_leaves = treedef.flatten_up_to(state.second)
    p_leaves = treedef.flatten_up_to(params)
    n_shards = sharding.shards("stack") if layout is not None else 1
    mesh = jax.sharding.get_abstract_mesh()
    if n_shards > 1 or (layout is not None and not mesh.empty and mesh.shape["slice"] > 1):
      upd, bufs, bufs2 = split_over_devices([path for path, _ in paths_g], g_leaves, b_leaves,
                                            s_leaves, p_leaves, lr, m, wd, n_shards)
    else:
      upd, bufs, bufs2 = one_device(g_leaves, b_leaves, s_leaves, p_leaves, lr, m, wd)
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflat(upd), MuonState(it + 1, unflat(bufs), unflat(bufs2))

  return optax.GradientTransformation(init, update)


# -- groups ------------------------------------------------------------------------

def label(path: tuple[str, ...]) -> str:
  """The optimizer group of a parameter, from its path in the model."""
  head = path[0]
  if head == "lm_head":
    return "unembed"
  if head == "wte":
    return "embed"
  if head in ("smear_w", "smear_lambda"):
    return "smear"
  if head == "tables":
    return "table"
  if "coeffs" in path:
    return "alpha" if path[-1] == "alpha" else "beta_gamma"
  if head == "blocks":
    return "muon"
  raise ValueError(f"no optimizer group for parameter {'/'.join(path)}")


def splits_across_slices(path) -> bool:
  """Whether a parameter's optimizer state and update are split across slices as well
  as inside them (state_layout.update_specs): Muon's matrices, whose Polar Express is
  most of the optimizer's arithmetic; Adam's elementwise update repeats in every slice."""
  return label(tuple(str(k) for k in path)) == "muon"


def labels(params):
  def f(path, _):
    return label(tuple(str(k) for k in sharding.path_keys(path)))
  return jax.tree_util.tree_map_with_path(f, params)


def hyperparams(optim_cfg, n_embd: int, batch_tokens: int, scaling_params: int,
                ref_scaling_params: int) -> dict:
  """Effective learning rates and Muon weight decay (the reference's scaling): every
  base LR times sqrt(batch_tokens / 2^19), embedding-like ones also by (d/768)^-0.5,
  and the weight decay by D_ref/D (parameters of the dense layout, this run's against d12)."""
  dmodel_scale = (n_embd / 768) ** -0.5
  batch_scale = math.sqrt(batch_tokens / 2 ** 19)
  return {
      "unembed": optim_cfg.unembedding_lr * dmodel_scale * batch_scale,
      "embed": optim_cfg.embedding_lr * dmodel_scale * batch_scale,
      "smear": 0.2,  # fixed in the reference, not derived from a base LR
      "alpha": optim_cfg.scalar_lr * 0.01 * batch_scale,
      "beta_gamma": optim_cfg.scalar_lr * batch_scale,
      "table": optim_cfg.embedding_lr * dmodel_scale * 0.5 * batch_scale,
      "muon": optim_cfg.matrix_lr * batch_scale,
      "muon_weight_decay": (optim_cfg.weight_decay * batch_scale * ref_scaling_params
                            / scaling_params),
  }


def make(optim_spec, num_iterations: int, rates: dict | None = None,
         layout=None) -> optax.GradientTransformation:
  """The whole optimizer for an OptimSpec, with `rates` from `hyperparams` (default: the
  effective values resolved into it, `optim_spec.hyperparams`); `layout`
  (a `state_layout.UpdateLayout`) splits Muon's work over the mesh (optim.shard_optimizer)."""
  rates = optim_spec.hyperparams if rates is None else rates
  mult = lambda it: lr_multiplier(it, num_iterations, optim_spec.warmup_steps,
                                  optim_spec.warmdown_ratio, optim_spec.final_lr_frac)
  groups = {}
  for name, (betas, wd) in ADAM_GROUPS.items():
    groups[name] = optax.adamw(learning_rate=lambda it, lr=rates[name]: lr * mult(it),
                               b1=betas[0], b2=betas[1], eps=1e-10, weight_decay=wd)
  groups["muon"] = muon(
      learning_rate=lambda it: rates["muon"] * mult(it),
      momentum=lambda it: muon_momentum(it, num_iterations, optim_spec.warmdown_ratio),
      weight_decay=lambda it: muon_weight_decay(it, num_iterations, rates["muon_weight_decay"]),
      batched=optim_spec.muon_batched, polar_dtype=jnp.dtype(optim_spec.polar_dtype),
      polar_gram=optim_spec.polar_gram,
      update_dtype=jnp.dtype(optim_spec.update_dtype), layout=layout)
  return optax.partition(groups, labels)
