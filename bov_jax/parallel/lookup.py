"""Reading a value table by token id on a mesh, without ever gathering the table.

A BoV table is [V, K * E] per target layer, its width split over fsdp and its vocabulary
over tensor (sharding.RULES). model.table_lookup reads rows E[idx] one of these ways:
  shard_map  each device takes, for the ids of every sequence sharing its fsdp group,
             the columns it holds (rows of a tensor-split vocabulary it does not hold
             masked to zero, then a psum over tensor), and an all-to-all over fsdp gives
             each device its own sequences' whole rows: what moves is one copy of the
             rows looked up, never the table. The backward is the same in reverse and a
             local scatter-add. The default (`auto`); a plain gather where the table is
             not split.
  gather     jnp.take under the compiler's sharding propagation (shard_map's form under
             an enclosing shard_map: see `embedding_lookup`).
  one_hot    one_hot(idx) @ E: a matmul, which all-gathers a split table.
Tables kept in host memory (`on_host`: inference only, sample.tables_on_host) are
gathered there whatever the setting; only the rows move to the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

from bov_jax.parallel.sharding import axes_of
from bov_jax.parallel.sharding import batch_axes
from bov_jax.parallel.sharding import free_axes
from bov_jax.parallel.sharding import in_shard_map
from bov_jax.parallel.sharding import logical_to_spec

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
  return SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def place_on_host(x):
  return jax.device_put(x, _memory("pinned_host"))


@compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
@jax.jit
def _take_on_host(t, i):
  return t.at[i].get(mode="promise_in_bounds")  # ids are valid tokens


def _host_take(table, idx):
  rows = _take_on_host(table, jax.device_put(idx, _memory("pinned_host")))
  return jax.device_put(rows, _memory("device"))


def table_axes(mesh, table_shape):
  """(vocabulary axes, width axes): the mesh axes a table of this shape is split over."""
  spec = logical_to_spec(("table_vocab", "table_width"), table_shape, mesh)
  return axes_of(spec[0]), axes_of(spec[1])


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


def embedding_lookup(table_VD, idx_BT):
  """table[idx]; inside a shard_map (`in_shard_map`) by `table_lookup`'s own."""
  return table_lookup(table_VD, idx_BT) if in_shard_map() else table_VD[idx_BT]


