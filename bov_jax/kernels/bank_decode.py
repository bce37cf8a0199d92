"""One decode step's attention in a bank layer, with the table gather fused in (Pallas).

A bank layer caches no values: its value at cached position s is gamma * E[ids[s]]
(the paper, Section 5: inference without a value cache). Written in XLA
(`kvcache`), every decode step gathers the rows of all cached positions into a
[B * K, S, E] buffer in HBM and attention reads that buffer back: the rows cross
HBM three times, where a layer with a stored value cache reads them once. These
kernels read each row once, straight from the table, so a bank layer decodes at
the memory traffic of a stored-value layer with a cache that holds only ids.

  tpu  bank_decode_tpu.py (Mosaic): rows DMA'd into VMEM a block ahead
  gpu  bank_decode_gpu.py (Triton): rows loaded by pointer, flash-decoding splits

`model.decode_attention` (resolved in spec.py): `xla` keeps the gather-then-attend
path; `fused` runs the target's kernel (off TPU and GPU, the TPU kernel in the
Pallas interpreter: slow, for tests); `fused_if_compiles`, what `auto` becomes on
TPU, is decided before tracing (`resolve`): the TPU kernel where it compiles for the
target device at the model's shapes, otherwise XLA's gather, with a warning. The
kernels' figures: docs/performance.md.

Layout (as `attention.attend` takes it): rows n = b * K + h, one per sequence b
and kv head h; G query heads per kv head. A key block outside the query's window
is neither fetched nor computed. With a vocab-split table (under a mesh) each
shard gathers only its own rows, the others count as zero, and the partial
outputs (normalised by the full softmax, which every shard computes alike from
the same keys) are summed with `psum`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import PartitionSpec as P

from bov_jax.kernels import bank_decode_gpu as gpu
from bov_jax.kernels import bank_decode_tpu as tpu
from bov_jax.parallel import lookup
from bov_jax.parallel import sharding


def fits(context: int, head_dim: int, platform: str = "tpu") -> bool:
  """Whether the kernel (`tpu` or `gpu`) takes this cache length and head dim."""
  return (gpu if platform == "gpu" else tpu).fits(context, head_dim)


def kernel_for(setting: str, context: int, head_dim: int, tables_on_host: bool, batch: int = 1,
               table_shape=None, *, platform: str = "tpu") -> str:
  """`fused` or `xla` for this cache under `model.decode_attention` (resolved: `xla` or
  `fused`; `fused_if_compiles` is decided by `resolve` before tracing). A cache the
  kernel does not fit, tables kept in host memory (`sample.tables_on_host`), and a
  mesh that splits the table's rows or shares an axis between the batch and the
  table (`mesh_split`) take `xla`."""
  if setting == "fused_if_compiles":
    raise ValueError("model.decode_attention='fused_if_compiles' is decided for the target "
                     "device before tracing (bank_decode.resolve)")
  if (setting == "xla" or tables_on_host or not fits(context, head_dim, platform)
      or mesh_split(batch, table_shape) is None):
    return "xla"
  return "fused"


def resolve(spec, device=None):
  """The model spec with `fused_if_compiles` decided for the target device (default:
  this process's first): `fused` where the TPU kernel compiles there for every bank
  layer's window at the model's context, else `xla`, with a warning. A kernel Mosaic
  rejects must not take a TPU run's decoding down with it; `model.decode_attention=fused`
  skips the check (and fails loudly)."""
  import dataclasses
  if spec.decode_attention != "fused_if_compiles":
    return spec
  windows = sorted({min(w, spec.sequence_len) for layer_value, w in zip(spec.layers, spec.windows)
                    if layer_value.is_bank})
  ok = all(compiles(spec.n_kv_head, spec.n_head // spec.n_kv_head, spec.head_dim,
                    spec.sequence_len, w, spec.dtype, spec.padded_vocab,
                    spec.embedding_dtype, device or jax.devices()[0])
           for w in windows) if fits(spec.sequence_len, spec.head_dim) else False
  return dataclasses.replace(spec, decode_attention="fused" if ok else "xla")


@functools.lru_cache(maxsize=None)
def compiles(n_kv_head: int, group: int, head_dim: int, context: int, window: int, dtype: str,
             table_rows: int, table_dtype: str, device) -> bool:
  """Whether the TPU kernel compiles for `device` for one sequence of these shapes
  (a whole table: a split one is refused by `mesh_split`); asked once per shape."""
  K, E = n_kv_head, head_dim
  one = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in (
      ((K, group, E), dtype), ((K, context, E), dtype), ((1, context), jnp.int32),
      ((table_rows, K * E), table_dtype), ((1,), jnp.int32), ((1,), jnp.int32))]
  call = functools.partial(tpu.call, window=window, split=False, interpret=False)
  try:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      jax.jit(call).lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except  (any compile failure means: not here)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    logging.warning("model.decode_attention=auto: the fused bank-layer decode kernel did "
                    "not compile on %s for head_dim=%d, %d query heads per kv head, "
                    "context=%d (%s); decoding gathers with XLA instead. "
                    "model.decode_attention=xla skips this check.",
                    device.device_kind, E, group, context, first)
    return False
  return True


def mesh_split(batch: int, table_shape):
  """(batch axes, vocab axes) the kernel runs split over under the current mesh, or
  None where it cannot run: a table whose rows are split across devices
  (`table_width`: each device holds part of every row), or a batch and a table
  vocabulary that share a split axis (a sequence's rows then sit on other devices).
  XLA's lookup, which moves rows, takes those. The batch is split as
  `lookup.table_lookup` splits it (not at all when it does not divide)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return (), ()
  vocab, width = lookup.table_axes(mesh, table_shape) if table_shape else ((), ())
  batch_axes = sharding.batch_axes(mesh, batch)
  if width or set(batch_axes) & set(vocab):
    return None
  return batch_axes, vocab


def attend(q_BTHE, k_NSE, ids_BS, table_VF, qpos_B, window: int, gamma=None,
           kernel: str = "tpu", interpret: bool = False):
  """Attention output [B, 1, H * E] of one new token per sequence over its cache.

  q_BTHE [B, 1, H, E]; k_NSE the layer's key cache (`attention.kv_rows`); ids_BS
  the cached token ids; table_VF the layer's table [V, K * E]; qpos_B each query's
  position (keys qpos - window .. qpos are visible); gamma the layer's learned
  coefficient (None: 1). Equal to `attention.attend` over gamma * table[ids] rows.
  kernel: `tpu` or `gpu`; interpret: in the Pallas interpreter (a target that is
  neither, or tests).
  """
  B, T, H, E = q_BTHE.shape
  if T != 1:
    raise ValueError(f"bank_decode.attend takes one new token per sequence, got {T}")
  N = k_NSE.shape[0]
  K = N // B
  q_NGE = q_BTHE.reshape(B, K, H // K, E).reshape(N, H // K, E)
  call = {"tpu": tpu.call, "gpu": gpu.call}[kernel]
  window = int(min(window, k_NSE.shape[1]))
  split = mesh_split(B, table_VF.shape)
  if split is None:
    raise ValueError("bank_decode.attend: the mesh splits the batch and the table over a "
                     "shared axis; `kernel_for` sends this case to XLA's lookup")
  batch_axes, vocab = split

  def local(q, k, ids, table, qpos):
    # With a vocab-split table this shard's rows start at its index times its rows;
    # the others count as zero here and the psum adds them.
    vstart = jax.lax.axis_index(vocab) * table.shape[0] if vocab else 0
    out = call(q, k, ids, table, qpos, jnp.asarray(vstart, jnp.int32)[None], window=window,
               split=bool(vocab), interpret=interpret)
    return jax.lax.psum(out.astype(jnp.float32), vocab).astype(out.dtype) if vocab else out

  if batch_axes or vocab:
    rows = P(batch_axes or None)  # rows n = b * K + h: a batch split keeps a sequence's rows
    mesh = jax.sharding.get_abstract_mesh()
    local = jax.shard_map(local, mesh=mesh,
                          in_specs=(rows, rows, rows, P(vocab or None, None), rows),
                          out_specs=rows, axis_names=sharding.free_axes(mesh), check_vma=False)
  out = local(q_NGE, k_NSE, ids_BS, table_VF, qpos_B)
  if gamma is not None:
    out = gamma.astype(out.dtype) * out
  return out.reshape(B, 1, H * E)
