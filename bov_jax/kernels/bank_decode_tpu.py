"""The fused bank-layer decode kernel for TPU (Mosaic): a bank layer's table rows DMA'd
into VMEM inside one decode step's attention (see bank_decode.py).

Grid (core, row, 128-position block); one DMA per cached position from its table row
into VMEM, a block ahead of its use (double buffer), and across rows: a core runs its
rows in order, and a row's last block requests the next row's first, so only a core's
first block waits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bov_jax.kernels import div

BLOCK = 128  # cached positions per grid step: one 128-row key tile, 128 row DMAs
CORES = 2  # megacore chips split the rows over two TensorCores
LANES = 128  # running max and sum are kept lane-replicated, as TPU flash kernels do


def fits(context: int, head_dim: int) -> bool:
  """Whole 128-position blocks and lane-wide head dims."""
  return context % BLOCK == 0 and head_dim % 128 == 0


def _kernel(qpos_ref, vstart_ref, ids_ref, ids_next_ref, q_ref, k_ref, table_ref, o_ref,
                vbuf, sems, m_ref, l_ref, acc_ref, count_ref, *, K, R, window, local_rows,
                split):
  """One (core, row, key block) grid step: the block's rows gathered by DMA, a block
  ahead, across rows too (a core runs its R rows in order)."""
  r, j = pl.program_id(1), pl.program_id(2)
  n = pl.program_id(0) * R + r
  b, h = div(n, K), jax.lax.rem(n, np.int32(K))
  qpos = qpos_ref[b]
  lo, hi = _block_range(qpos, window)

  @pl.when((r == 0) & (j == 0))
  def _start():
    count_ref[0] = 0  # blocks this core has computed: their parity picks the vbuf half

  slot = jax.lax.rem(count_ref[0], np.int32(2))  # vbuf half holding block j's rows

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def row_of(ids, i, head):
    tok = ids[0, i] - vstart_ref[0]
    mine = (tok >= 0) & (tok < local_rows)
    return jnp.where(mine, tok, 0) * K + head, mine

  def copy(ids, i, half, head=h):
    return pltpu.make_async_copy(table_ref.at[pl.ds(row_of(ids, i, head)[0], 1)],
                                 vbuf.at[half, pl.ds(i, 1)], sems.at[half])

  def request(ids, half, head=h):
    jax.lax.fori_loop(0, BLOCK, lambda i, c: (copy(ids, i, half, head).start(), c)[1], 0)

  # Rows are requested a block ahead: block j + 1's DMAs run while block j is
  # computed, and a row's last block requests the next row's first, so only a
  # core's first block waits on its gather.
  @pl.when((j == lo) & (r == 0))
  def _first():
    request(ids_ref, slot)

  @pl.when((j >= lo) & (j < hi))
  def _ahead():
    request(ids_next_ref, 1 - slot)

  @pl.when((j == hi) & (r + 1 < R))
  def _next_row():
    request(ids_next_ref, 1 - slot, jax.lax.rem(n + 1, np.int32(K)))

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
    jax.lax.fori_loop(0, BLOCK, lambda i, c: (copy(ids_ref, i, slot).wait(), c)[1], 0)
    rows = vbuf.at[slot]
    if split:  # rows another shard holds count as zero here; the psum adds them
      def clear(i, c):
        @pl.when(jnp.logical_not(row_of(ids_ref, i, h)[1]))
        def _():
          rows[pl.ds(i, 1), :] = jnp.zeros((1, rows.shape[1]), rows.dtype)
        return c
      jax.lax.fori_loop(0, BLOCK, clear, 0)
    v = rows[...].astype(jnp.float32)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)
    count_ref[0] += 1

  @pl.when(j == pl.num_programs(2) - 1)
  def _out():
    o_ref[...] = (acc_ref[...] / l_ref[...][:, :1]).astype(o_ref.dtype)


def _block_range(qpos, window):
  """First and last key block a query at qpos sees (keys qpos - window .. qpos)."""
  return div(jnp.maximum(qpos - window, 0), BLOCK), div(qpos, BLOCK)


def call(q_NGE, k_NSE, ids_BS, table_VF, qpos_B, vstart, *, window, split, interpret):
  N, G, E = q_NGE.shape
  B, S = ids_BS.shape
  K = N // B
  V = table_VF.shape[0]
  table_RE = table_VF.reshape(V * K, E)  # row id * K + h: one kv head's value of token id
  nb = S // BLOCK
  # The ids of one block as the whole of a [1, 128] array: TPU blocks must fill
  # (8, 128) tiles or whole dimensions, and SMEM holds only this block.
  ids_R1C = ids_BS.astype(jnp.int32).reshape(B * nb, 1, BLOCK)

  # Rows split over CORES: Mosaic gives a megacore chip's two TensorCores one half
  # each of a "parallel" dimension, and each core runs its rows in order
  # ("arbitrary"), which the cross-row request needs.
  C = CORES if N % CORES == 0 else 1
  R = N // C

  def key_block(n, j, qpos):
    lo, hi = _block_range(qpos[div(n, K)], window)
    return jnp.clip(j, lo, hi)

  def ids_block(c, r, j, qp, vs):
    n = c * R + r
    return (div(n, K) * nb + key_block(n, j, qp), 0, 0)

  def ids_next_block(c, r, j, qp, vs):
    """Block j + 1 of this row, or from the row's last block on, the next row's
    first (the rows requested ahead)."""
    n = c * R + r
    nxt = jnp.minimum(n + 1, N - 1)
    last = j >= _block_range(qp[div(n, K)], window)[1]
    return (jnp.where(last, div(nxt, K) * nb + _block_range(qp[div(nxt, K)], window)[0],
                      div(n, K) * nb + key_block(n, j + 1, qp)), 0, 0)

  kernel = functools.partial(_kernel, K=K, R=R, window=window, local_rows=V, split=split)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(C, R, nb),
          in_specs=[
              pl.BlockSpec((None, 1, BLOCK), ids_block, memory_space=pltpu.SMEM),
              pl.BlockSpec((None, 1, BLOCK), ids_next_block, memory_space=pltpu.SMEM),
              pl.BlockSpec((None, G, E), lambda c, r, j, qp, vs: (c * R + r, 0, 0)),
              pl.BlockSpec((None, BLOCK, E),
                           lambda c, r, j, qp, vs: (c * R + r, key_block(c * R + r, j, qp), 0)),
              pl.BlockSpec(memory_space=pl.ANY),
          ],
          out_specs=pl.BlockSpec((None, G, E), lambda c, r, j, qp, vs: (c * R + r, 0, 0)),
          scratch_shapes=[
              pltpu.VMEM((2, BLOCK, E), table_VF.dtype),
              pltpu.SemaphoreType.DMA((2,)),
              pltpu.VMEM((G, LANES), jnp.float32),
              pltpu.VMEM((G, LANES), jnp.float32),
              pltpu.VMEM((G, E), jnp.float32),
              pltpu.SMEM((1,), jnp.int32),
          ]),
      out_shape=jax.ShapeDtypeStruct((N, G, E), q_NGE.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
  )(qpos_B.astype(jnp.int32), vstart, ids_R1C, ids_R1C, q_NGE, k_NSE, table_RE)

