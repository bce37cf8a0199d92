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
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bov_jax.settings.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (or axes), MaxText style.
RULES = {
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    # A value table [V, K * E] is split over its width on fsdp, where the batch is split
    # too: a lookup then moves each device's rows once (all-to-all, `table_lookup`),
    # and no table is ever gathered whole.
    "table_vocab": "tensor",
    "table_width": "fsdp",
    "batch": BATCH_AXES,  # activations' rows
    # The optimizer's stack of same-shaped matrices (optim.muon): split over every
    # axis, so each device orthogonalises whole matrices of its own (nanochat's
    # distributed Muon; MaxText's sharding-aware Muon).
    "stack": MESH_AXES,
}


def path_keys(path) -> tuple:
  """A tree path (jax's key path) as its dict keys and sequence indices; attribute keys
  (a namedtuple's fields in optimizer state) are left out."""
  return tuple(k.key if isinstance(k, jax.tree_util.DictKey) else k.idx for k in path
               if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey)))


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


def _manual(mesh) -> tuple:
  """The axes a shard_map around this code has made manual (none outside one)."""
  return tuple(getattr(mesh, "manual_axes", ()))


def in_shard_map() -> bool:
  """Whether this is traced inside a shard_map over part of the mesh (the data-parallel
  step's): there XLA's partitioner fails a check partitioning a gather from an array
  split over both other axes (data x fsdp x tensor), so gathers take other forms."""
  return bool(_manual(jax.sharding.get_abstract_mesh()))


def free_axes(mesh) -> set:
  """The mesh axes a shard_map here may take: those no enclosing shard_map has."""
  return set(mesh.axis_names) - set(_manual(mesh))


def logical_to_spec(logical, shape, mesh) -> P:
  """Mesh axes for a parameter; an axis that does not divide stays replicated, and so
  does one a shard_map around the caller has taken (its shards are already local)."""
  spec, used = [], set(_manual(mesh))
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


def constrain(x, logical):
  """x with its dimensions split as RULES and the batch axes say (activations: "batch"
  is the rows' axes), under the current mesh; a no-op without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical, x.shape, mesh))


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
# A BoV table is [V, K * E] per target layer, its width split over fsdp and its
# vocabulary over tensor (RULES). model.table_lookup reads rows E[idx] one of these ways:
#   shard_map  each device takes, for the ids of every sequence sharing its fsdp
#              group, the columns it holds (rows of a tensor-split vocabulary it
#              does not hold masked to zero, then a psum over tensor), and an
#              all-to-all over fsdp gives each device its own sequences' whole rows:
#              what moves is one copy of the rows looked up, never the table. The
#              backward is the same in reverse and a local scatter-add. The default
#              (`auto`); a plain gather where the table is not split.
#   gather     jnp.take under the compiler's sharding propagation (shard_map's form under
#              an enclosing shard_map: see `embedding_lookup`).
#   one_hot    one_hot(idx) @ E: a matmul, which all-gathers a split table.
# Tables kept in host memory (`on_host`: inference only, sample.tables_on_host) are
# gathered there whatever the setting; only the rows move to the device.


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


def axes_of(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def table_axes(mesh, table_shape):
  """(vocabulary axes, width axes): the mesh axes a table of this shape is split over."""
  spec = logical_to_spec(("table_vocab", "table_width"), table_shape, mesh)
  return axes_of(spec[0]), axes_of(spec[1])


def batch_axes(mesh, batch: int) -> tuple:
  """The mesh axes a batch of this many rows is split over: the batch axes of size > 1,
  or none when the batch does not divide (decoding one sequence)."""
  axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1 and a not in _manual(mesh))
  return axes if batch % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def batch_shards(batch: int) -> int:
  """How many ways the current mesh splits a batch of this many rows (1 off a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else math.prod(mesh.shape[a] for a in batch_axes(mesh, batch))


def table_lookup(table_VF, idx_BT, impl: str = "shard_map", on_host: bool = False):
  """Rows of a (possibly split) table for token ids, [B, T, F]."""
  mesh = jax.sharding.get_abstract_mesh()
  if on_host:
    return _host_take(table_VF, idx_BT)
  if impl == "one_hot":
    return jax.nn.one_hot(idx_BT, table_VF.shape[0], dtype=table_VF.dtype) @ table_VF
  if mesh.empty or (impl == "gather" and not in_shard_map()):
    return jnp.take(table_VF, idx_BT, axis=0)
  vocab, width = table_axes(mesh, table_VF.shape)
  if not vocab and not width:
    return jnp.take(table_VF, idx_BT, axis=0)
  rows_axes = batch_axes(mesh, idx_BT.shape[0])
  shared = tuple(a for a in width if a in rows_axes)  # all-to-all: ids in, rows out
  only_width = tuple(a for a in width if a not in shared)  # all-gathered columns

  def local(table, idx):
    if shared:  # the ids of every sequence of the group
      idx = jax.lax.all_gather(idx, shared, axis=0, tiled=True)
    if vocab:
      n = table.shape[0]
      offset = idx - jax.lax.axis_index(vocab) * n
      mine = (offset >= 0) & (offset < n)
      rows = jnp.take(table, jnp.where(mine, offset, 0), axis=0)
      rows = jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype)), vocab)
    else:
      rows = jnp.take(table, idx, axis=0)
    if only_width:
      rows = jax.lax.all_gather(rows, only_width, axis=2, tiled=True)
    if shared:  # each device's sequences back to it, with every device's columns
      rows = jax.lax.all_to_all(rows, shared, 0, 2, tiled=True)
    return rows

  bspec = rows_axes or None
  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(vocab or None, width or None), P(bspec, None)),
      out_specs=P(bspec, None, None), axis_names=free_axes(mesh),
      check_vma=False)(table_VF, idx_BT)


def sum_over_rows(fn, rows, shared):
  """fn(*rows, *shared), a scalar summed over the rows' leading (batch) axis. Where the
  mesh splits that axis, each device runs fn on its own rows with `shared` whole (a
  shard_map over the batch axes) and the sums are added: each device's contribution to
  a shared input's gradient is then reduced once, not after every step of fn's loops
  (under FSDP the LM head's gradient was reduce-scattered after every loss chunk)."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else batch_axes(mesh, rows[0].shape[0])
  if not axes:
    return fn(*rows, *shared)
  body = lambda *args: jax.lax.psum(fn(*args), axes)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * len(rows) + (P(),) * len(shared),
                       out_specs=P(), axis_names=set(axes), check_vma=False)(*rows, *shared)


def embedding_lookup(table_VD, idx_BT):
  """table[idx]; inside a shard_map (`in_shard_map`) by `table_lookup`'s own."""
  return table_lookup(table_VD, idx_BT) if in_shard_map() else table_VD[idx_BT]


def shards(logical: str) -> int:
  """How many ways the current mesh splits a dimension of this logical axis that
  divides (1 off a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = axes_of(RULES[logical])
  return math.prod(mesh.shape[a] for a in axes if a not in _manual(mesh))


def param_specs_of(shardings):
  return jax.tree.map(lambda s: s.spec, shardings,
                      is_leaf=lambda x: isinstance(x, NamedSharding))
