"""The fused bank-layer decode kernel for GPU (Pallas Triton), see bank_decode.py.

Grid (row, 16 splits of the cache), each split looping over 64-position blocks whose
value rows it loads by pointer (a gather load); the splits' partial softmaxes are
joined after (flash decoding).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bov_jax.kernels import div

GPU_BLOCK = 64  # cached positions per loop step
GPU_SPLITS = 16  # programs per (sequence, kv head), each over a 16th of the cache,
                 # so a batch of one still fills the SMs (flash decoding's split-K)
GPU_ROWS = 16  # query heads padded to 16 rows (Triton's smallest dot) or more
MASKED = -0.7 * float(np.finfo(np.float32).max)  # finite: no inf - inf in the kernel


def fits(context: int, head_dim: int) -> bool:
  """Whole 64-position blocks and power-of-two head dims of at least 16 (Triton's
  tensor shapes and dot sizes)."""
  return context % GPU_BLOCK == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _kernel(qpos_ref, vstart_ref, ids_ref, q_ref, k_ref, table_ref, o_ref, l_ref, m_ref,
                *, K, window, local_rows, split, per_split):
  """One (row, split) program: the split's blocks inside the query's window, each
  gathered from the table by pointer (Triton's gather load) as it is used."""
  n, sp = pl.program_id(0), pl.program_id(1)
  h = jax.lax.rem(n, np.int32(K))
  qpos = qpos_ref[0]
  first = div(jnp.maximum(jnp.maximum(qpos - window, 0), sp * per_split), GPU_BLOCK)
  last = div(jnp.minimum(qpos, (sp + 1) * per_split - 1), GPU_BLOCK)  # may be < first
  q = q_ref[...]
  scale = 1.0 / math.sqrt(q.shape[-1])

  def body(blk, carry):
    o, m, l = carry
    at = pl.ds(blk * GPU_BLOCK, GPU_BLOCK)
    tok = ids_ref[at] - vstart_ref[0]
    mine = (tok >= 0) & (tok < local_rows)
    v = table_ref[jnp.where(mine, tok, 0) * K + h, :]
    if split:  # rows another shard holds count as zero here; the psum adds them
      v = jnp.where(mine[:, None], v, jnp.zeros((), v.dtype))
    s = plgpu.dot(q, k_ref[at, :], trans_b=True).astype(jnp.float32) * scale
    delta = qpos - (blk * GPU_BLOCK + jnp.arange(GPU_BLOCK))
    s = jnp.where(((delta >= 0) & (delta <= window))[None, :], s, MASKED)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_next[:, None])
    alpha = jnp.exp(m - m_next)
    o = alpha[:, None] * o + plgpu.dot(p.astype(q.dtype), v.astype(q.dtype)).astype(jnp.float32)
    return o, m_next, alpha * l + jnp.sum(p, axis=1)

  init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full(m_ref.shape, MASKED, jnp.float32),
          jnp.zeros(l_ref.shape, jnp.float32))
  o, m, l = jax.lax.fori_loop(first, last + 1, body, init)
  o_ref[...], m_ref[...], l_ref[...] = o, m, l


def call(q_NGE, k_NSE, ids_BS, table_VF, qpos_B, vstart, *, window, split, interpret):
  N, G, E = q_NGE.shape
  B, S = ids_BS.shape
  K = N // B
  V = table_VF.shape[0]
  splits = math.gcd(GPU_SPLITS, S // GPU_BLOCK)
  per_split = S // splits
  R = max(GPU_ROWS, 1 << (G - 1).bit_length())  # Triton's tensors: powers of two
  q_NRE = jnp.pad(q_NGE, ((0, 0), (0, R - G), (0, 0)))
  kernel = functools.partial(_kernel, K=K, window=window, local_rows=V, split=split,
                             per_split=per_split)
  o, l, m = pl.pallas_call(
      kernel,
      grid=(N, splits),
      in_specs=[
          pl.BlockSpec((1,), lambda n, sp: (n // K,)),
          pl.BlockSpec((1,), lambda n, sp: (0,)),
          pl.BlockSpec((None, S), lambda n, sp: (n // K, 0)),
          pl.BlockSpec((None, R, E), lambda n, sp: (n, 0, 0)),
          pl.BlockSpec((None, S, E), lambda n, sp: (n, 0, 0)),
          pl.BlockSpec((V * K, E), lambda n, sp: (0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, R, E), lambda n, sp: (sp, n, 0, 0)),
          pl.BlockSpec((None, None, R), lambda n, sp: (sp, n, 0)),
          pl.BlockSpec((None, None, R), lambda n, sp: (sp, n, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((splits, N, R, E), jnp.float32),
                 jax.ShapeDtypeStruct((splits, N, R), jnp.float32),
                 jax.ShapeDtypeStruct((splits, N, R), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
  )(qpos_B.astype(jnp.int32), vstart, ids_BS.astype(jnp.int32), q_NRE, k_NSE,
    table_VF.reshape(V * K, E))
  # The splits' partial softmaxes joined (a split without visible keys has m at
  # MASKED and weighs nothing).
  m_all = jnp.max(m, axis=0)
  w = jnp.exp(m - m_all)
  out = jnp.sum(o * w[..., None], axis=0) / jnp.sum(l * w, axis=0)[..., None]
  return out[:, :G].astype(q_NGE.dtype)

