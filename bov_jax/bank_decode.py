"""One decode step's attention in a bank layer, with the table gather fused in (Pallas, TPU).

A bank layer caches no values: its value at cached position s is gamma * E[ids[s]]
(SPEC section 7). Written in XLA (`inference._cached_values`), every decode step
gathers the rows of all cached positions into a [B * K, S, E] buffer in HBM and
attention reads that buffer back: the rows cross HBM three times, where a layer
with a stored value cache reads them once. This kernel reads each row once,
straight from the table into VMEM by DMA, a block ahead of its use, so a bank layer decodes at the memory traffic of a stored-value layer with a
cache that holds only ids.

`model.decode_attention` picks it: `auto` takes it on TPU when it fits (`fits`),
`fused` asks for it anywhere (off TPU it runs in the Pallas interpreter: slow, for
tests), `xla` keeps the gather-then-attend path. Its speed on a TPU is not
measured (docs/performance.md): no TPU was available.

Layout (as `attention.attend` takes it): rows n = b * K + h, one per sequence b
and kv head h; G query heads per kv head. Grid (row, key block); a key block
outside the query's window is neither fetched nor computed (the index maps hold
the last block the window reaches, so the pipeline fetches nothing new). With a
vocab-split table (under a mesh) each shard gathers only its own rows, the
others count as zero, and the partial outputs (normalised by the full softmax,
which every shard computes alike from the same keys) are summed with `psum`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from bov_jax import sharding

IMPLS = ("auto", "xla", "fused")
BLOCK = 128  # cached positions per grid step: one 128-row key tile, 128 row DMAs
LANES = 128  # running max and sum are kept lane-replicated, as TPU flash kernels do


def fits(context: int, head_dim: int) -> bool:
  """What the kernel takes: whole 128-position blocks and lane-wide head dims."""
  return context % BLOCK == 0 and head_dim % 128 == 0


def resolve(impl: str, context: int, head_dim: int, table_lookup: str) -> str:
  """`fused` or `xla` for this cache. Tables kept in host memory are always
  gathered by XLA (`sample.tables_on_host`)."""
  if table_lookup == "host":
    return "xla"
  if impl == "auto":
    return "fused" if jax.default_backend() == "tpu" and fits(context, head_dim) else "xla"
  if impl == "fused" and context % BLOCK:
    return "xla"
  return impl


def _kernel(qpos_ref, vstart_ref, ids_ref, ids_next_ref, q_ref, k_ref, table_ref, o_ref,
            vbuf, sems, m_ref, l_ref, acc_ref, *, K, window, local_rows, split):
  n, j = pl.program_id(0), pl.program_id(1)
  b, h = _div(n, K), jax.lax.rem(n, np.int32(K))
  qpos = qpos_ref[b]
  lo, hi = _block_range(qpos, window)
  slot = jax.lax.rem(jnp.maximum(j - lo, 0), np.int32(2))  # vbuf half holding block j's rows

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def row_of(ids, r):
    tok = ids[0, r] - vstart_ref[0]
    mine = (tok >= 0) & (tok < local_rows)
    return jnp.where(mine, tok, 0) * K + h, mine

  def copy(ids, r, half):
    return pltpu.make_async_copy(table_ref.at[pl.ds(row_of(ids, r)[0], 1)],
                                 vbuf.at[half, pl.ds(r, 1)], sems.at[half])

  def request(ids, half):
    jax.lax.fori_loop(0, BLOCK, lambda r, c: (copy(ids, r, half).start(), c)[1], 0)

  # Rows are requested a block ahead: block j + 1's DMAs run while block j is
  # computed, so after the first block the scores never wait on a gather.
  @pl.when(j == lo)
  def _first():
    request(ids_ref, slot)

  @pl.when((j >= lo) & (j < hi))
  def _ahead():
    request(ids_next_ref, 1 - slot)

  @pl.when((j >= lo) & (j <= hi))
  def _block():
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    delta = qpos - (j * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1))
    s = jnp.where((delta >= 0) & (delta <= window), s, -jnp.inf)
    m_prev = m_ref[...][:, :1]
    # The first block processed always holds a visible key (the window's first
    # position or the query's own), so m is finite from then on.
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_next)
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = jnp.broadcast_to(alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True),
                                  l_ref.shape)
    m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
    jax.lax.fori_loop(0, BLOCK, lambda r, c: (copy(ids_ref, r, slot).wait(), c)[1], 0)
    rows = vbuf.at[slot]
    if split:  # rows another shard holds count as zero here; the psum adds them
      def clear(r, c):
        @pl.when(jnp.logical_not(row_of(ids_ref, r)[1]))
        def _():
          rows[pl.ds(r, 1), :] = jnp.zeros((1, rows.shape[1]), rows.dtype)
        return c
      jax.lax.fori_loop(0, BLOCK, clear, 0)
    v = rows[...].astype(jnp.float32)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _out():
    o_ref[...] = (acc_ref[...] / l_ref[...][:, :1]).astype(o_ref.dtype)


def _block_range(qpos, window):
  """First and last key block a query at qpos sees (keys qpos - window .. qpos)."""
  return _div(jnp.maximum(qpos - window, 0), BLOCK), _div(qpos, BLOCK)


def _div(a, d: int):
  """a // d for a >= 0. Truncating division: `//` on signed integers lowers
  through `sign`, which Mosaic lowers per TPU generation, so a lowering check
  off TPU could not run it."""
  return jax.lax.div(a, np.int32(d))


def _call(q_NGE, k_NSE, ids_BS, table_VF, qpos_B, vstart, *, window, split, interpret):
  N, G, E = q_NGE.shape
  B, S = ids_BS.shape
  K = N // B
  V = table_VF.shape[0]
  table_RE = table_VF.reshape(V * K, E)  # row id * K + h: one kv head's value of token id
  nb = S // BLOCK
  # The ids of one block as the whole of a [1, 128] array: TPU blocks must fill
  # (8, 128) tiles or whole dimensions, and SMEM holds only this block.
  ids_R1C = ids_BS.astype(jnp.int32).reshape(B * nb, 1, BLOCK)

  def key_block(n, j, qpos, vstart):
    lo, hi = _block_range(qpos[_div(n, K)], window)
    return jnp.clip(j, lo, hi)

  kernel = functools.partial(_kernel, K=K, window=window, local_rows=V, split=split)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(N, nb),
          in_specs=[
              pl.BlockSpec((None, 1, BLOCK),
                           lambda n, j, qp, vs: (_div(n, K) * nb + key_block(n, j, qp, vs), 0, 0),
                           memory_space=pltpu.SMEM),
              pl.BlockSpec((None, 1, BLOCK),  # the next block's ids, for the rows ahead
                           lambda n, j, qp, vs: (_div(n, K) * nb + key_block(n, j + 1, qp, vs),
                                                 0, 0),
                           memory_space=pltpu.SMEM),
              pl.BlockSpec((None, G, E), lambda n, j, qp, vs: (n, 0, 0)),
              pl.BlockSpec((None, BLOCK, E), lambda n, j, qp, vs: (n, key_block(n, j, qp, vs), 0)),
              pl.BlockSpec(memory_space=pl.ANY),
          ],
          out_specs=pl.BlockSpec((None, G, E), lambda n, j, qp, vs: (n, 0, 0)),
          scratch_shapes=[
              pltpu.VMEM((2, BLOCK, E), table_VF.dtype),
              pltpu.SemaphoreType.DMA((2,)),
              pltpu.VMEM((G, LANES), jnp.float32),
              pltpu.VMEM((G, LANES), jnp.float32),
              pltpu.VMEM((G, E), jnp.float32),
          ]),
      out_shape=jax.ShapeDtypeStruct((N, G, E), q_NGE.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
  )(qpos_B.astype(jnp.int32), vstart, ids_R1C, ids_R1C, q_NGE, k_NSE, table_RE)


def attend(q_BTHE, k_NSE, ids_BS, table_VF, qpos_B, window: int, gamma=None):
  """Attention output [B, 1, H * E] of one new token per sequence over its cache.

  q_BTHE [B, 1, H, E]; k_NSE the layer's key cache (`attention.kv_rows`); ids_BS
  the cached token ids; table_VF the layer's table [V, K * E]; qpos_B each query's
  position (keys qpos - window .. qpos are visible); gamma the layer's learned
  coefficient (None: 1). Equal to `attention.attend` over gamma * table[ids] rows.
  """
  B, T, H, E = q_BTHE.shape
  if T != 1:
    raise ValueError(f"bank_decode.attend takes one new token per sequence, got {T}")
  N = k_NSE.shape[0]
  K = N // B
  q_NGE = q_BTHE.reshape(B, K, H // K, E).reshape(N, H // K, E)
  interpret = jax.default_backend() != "tpu"
  window = int(min(window, k_NSE.shape[1]))
  mesh = jax.sharding.get_abstract_mesh()
  vocab = () if mesh.empty or mesh.size == 1 else sharding.table_axes(mesh, table_VF.shape[0])
  if not vocab:
    out = _call(q_NGE, k_NSE, ids_BS, table_VF, qpos_B, jnp.zeros((1,), jnp.int32),
                window=window, split=False, interpret=interpret)
  else:
    def local(q, k, ids, table, qpos):
      vstart = (jax.lax.axis_index(vocab) * table.shape[0]).astype(jnp.int32)[None]
      part = _call(q, k, ids, table, qpos, vstart, window=window, split=True,
                   interpret=interpret)
      return jax.lax.psum(part.astype(jnp.float32), vocab).astype(part.dtype)
    out = jax.shard_map(local, mesh=mesh,
                        in_specs=(P(), P(), P(), P(vocab, None), P()), out_specs=P(),
                        check_vma=False)(q_NGE, k_NSE, ids_BS, table_VF, qpos_B)
  if gamma is not None:
    out = gamma.astype(out.dtype) * out
  return out.reshape(B, 1, H * E)
