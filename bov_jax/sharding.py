"""The device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters
and optimizer state split), `tensor` (within-layer model parallel). Every
parameter names its axes in model.py (`logical=`); RULES says where each goes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from bov_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (or axes), MaxText style.
RULES = {
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "table_vocab": ("fsdp", "tensor"),
}


def mesh_shape(mesh_cfg, n_devices: int | None = None) -> tuple[int, int, int]:
  """(data, fsdp, tensor) from the `mesh` settings: -1 takes the remaining devices."""
  n = jax.device_count() if n_devices is None else n_devices
  sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ConfigError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
  if any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(f"mesh sizes must be positive or -1; got data={sizes[0]}, "
                     f"fsdp={sizes[1]}, tensor={sizes[2]}")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if n % fixed:
      raise ConfigError(f"{n} devices are not divisible by the fixed mesh sizes (product {fixed})")
    sizes[free[0]] = n // fixed
  if math.prod(sizes) != n:
    raise ConfigError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = "
                     f"{math.prod(sizes)} devices, but {n} are available")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_cfg, len(devices))
  # Auto axes: sharding propagates through plain gathers (Explicit axes would
  # demand an out_sharding on every lookup).
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(logical, shape, mesh) -> P:
  """Mesh axes for a parameter; an axis that does not divide stays replicated."""
  spec, used = [], set()
  for name, dim in zip(logical or (), shape):
    axes = RULES.get(name)
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    if axes and dim % size == 0:
      spec.append(axes[0] if len(axes) == 1 else axes)
      used.update(axes)
    else:
      spec.append(None)
  return P(*spec)


def param_specs(abstract_state, mesh):
  """PartitionSpecs for a model's nnx.State (abstract or real), as a pure dict."""
  from flax import nnx
  specs = {}
  for path, var in nnx.to_flat_state(abstract_state):
    logical = var.get_metadata().get("logical", ())
    specs[path] = logical_to_spec(logical, var.shape, mesh)
  out = {}
  for path, spec in specs.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = spec
  return out


def named(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh, leading_dims: int = 1) -> NamedSharding:
  """Rows split over data x fsdp; `leading_dims` axes before the rows stay whole."""
  return NamedSharding(mesh, P(*([None] * (leading_dims - 1)), BATCH_AXES))


def global_batch(local: np.ndarray, mesh, leading_dims: int = 1):
  """A global array from each process's rows (multi-host: every process calls this)."""
  return jax.make_array_from_process_local_data(batch_sharding(mesh, leading_dims), local)


# -- value-table lookups ----------------------------------------------------------------
#
# A BoV table is [V, kv_dim] per target layer, split over its vocabulary axis
# (`table_vocab` -> fsdp x tensor). model.table_lookup reads rows E[idx] one of these
# ways:
#   shard_map  each device gathers the rows it owns (others masked to zero), then
#              psum over the vocab axes -- or psum_scatter over an axis that also
#              splits the batch. Only activations move; the backward is a local
#              scatter-add. The default (`auto`); a plain gather where the table is
#              not split.
#   gather     jnp.take under the compiler's sharding propagation.
#   one_hot    one_hot(idx) @ E: a matmul, which all-gathers an FSDP-split table.
#   host       (inference only, sample.tables_on_host) the table in host memory,
#              gathered there; only the rows move to the device.


# -- value tables in host memory (inference) -------------------------------------------
#
# The paper's suggestion: a bank table is only read by id, so it can live in host
# memory and each step fetches just the rows it needs. The gather runs on the host
# (compute_on), then only the rows move to the device.

def host_memory_supported(device=None) -> bool:
  device = device or jax.devices()[0]
  try:
    return any(m.kind == "pinned_host" for m in device.addressable_memories())
  except Exception:  # noqa: BLE001 - backends without the memories API
    return False


def _memory(kind: str):
  from jax.sharding import SingleDeviceSharding
  return SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def place_on_host(x):
  return jax.device_put(x, _memory("pinned_host"))


def _on_host(f):
  """compute_on("device_host") in jax 0.10, where it takes the compute type alone,
  and from 0.11, where it also asks which memory each output lands in."""
  try:
    return compute_on("device_host")(f)
  except TypeError:
    return compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(f)


@_on_host
@jax.jit
def _take_on_host(t, i):
  return t.at[i].get(mode="promise_in_bounds")  # ids are valid tokens


def _host_take(table, idx):
  rows = _take_on_host(table, jax.device_put(idx, _memory("pinned_host")))
  return jax.device_put(rows, _memory("device"))


def table_axes(mesh, n_rows: int):
  """The mesh axes the table's vocabulary is split over (what RULES gives it)."""
  spec = logical_to_spec(("table_vocab", None), (n_rows, 1), mesh)[0]
  if spec is None:
    return ()
  return (spec,) if isinstance(spec, str) else tuple(spec)


def table_lookup(table_VD, idx_BT, impl: str = "shard_map"):
  """Rows of a (possibly vocab-split) table for token ids, [B, T, D]."""
  mesh = jax.sharding.get_abstract_mesh()
  if impl == "host":
    return _host_take(table_VD, idx_BT)
  if impl == "one_hot":
    return jax.nn.one_hot(idx_BT, table_VD.shape[0], dtype=table_VD.dtype) @ table_VD
  if mesh.empty or impl == "gather":
    return jnp.take(table_VD, idx_BT, axis=0)
  vocab_axes = table_axes(mesh, table_VD.shape[0])
  if not vocab_axes:
    return jnp.take(table_VD, idx_BT, axis=0)
  batch_axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
  if idx_BT.shape[0] % math.prod(mesh.shape[a] for a in batch_axes):
    batch_axes = ()  # a batch too small to split (decoding one sequence)
  shared = tuple(a for a in vocab_axes if a in batch_axes)  # split both ways
  only_vocab = tuple(a for a in vocab_axes if a not in shared)

  def local(table, idx):
    if shared:  # ids of the whole group sharing these axes, then scatter the rows back
      idx = jax.lax.all_gather(idx, shared, axis=0, tiled=True)
    n = table.shape[0]
    start = jax.lax.axis_index(vocab_axes) * n
    offset = idx - start
    mine = (offset >= 0) & (offset < n)
    rows = jnp.take(table, jnp.where(mine, offset, 0), axis=0)
    rows = jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))
    if only_vocab:
      rows = jax.lax.psum(rows, only_vocab)
    if shared:
      rows = jax.lax.psum_scatter(rows, shared, scatter_dimension=0, tiled=True)
    return rows

  bspec = batch_axes if batch_axes else None
  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(vocab_axes, None), P(bspec, None)),
      out_specs=P(bspec, None, None),
      check_vma=False)(table_VD, idx_BT)


def _path_keys(path) -> tuple:
  out = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(k.key)
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(k.idx)
  return tuple(out)


def like_params(tree, param_specs, param_shapes):
  """PartitionSpecs for a tree holding copies of the parameters (optimizer state).

  A leaf whose path ends in a parameter's path takes that parameter's spec on
  every dimension of equal size (Muon's per-row statistics keep the split of
  the dimension they share); anything else (step counters) is replicated.
  """
  specs = {_path_keys(p): s for p, s in
           jax.tree_util.tree_leaves_with_path(param_specs, is_leaf=lambda x: isinstance(x, P))}
  shapes = {_path_keys(p): s for p, s in jax.tree_util.tree_leaves_with_path(param_shapes)}

  def f(path, leaf):
    keys = _path_keys(path)
    for start in range(len(keys)):
      if keys[start:] in specs:
        spec, shape = specs[keys[start:]], shapes[keys[start:]].shape
        if len(shape) != len(leaf.shape):
          return P()
        entries = list(spec) + [None] * (len(shape) - len(spec))
        return P(*[e if a == b else None for e, a, b in zip(entries, leaf.shape, shape)])
    return P()

  return jax.tree_util.tree_map_with_path(f, tree)


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


def param_specs_of(shardings):
  return jax.tree.map(lambda s: s.spec, shardings,
                      is_leaf=lambda x: isinstance(x, NamedSharding))
