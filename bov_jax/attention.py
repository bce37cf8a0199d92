"""Causal sliding-window GQA attention of a sequence over itself (training, prefill).

`model.attention` picks the kernel:
  auto    Splash attention on TPU (when the sequence fits its 128-row blocks),
          `blocks` on CPU, jax.nn.dot_product_attention on GPU
  xla     jax.nn.dot_product_attention: cuDNN flash attention on GPU where it
          applies, XLA otherwise
  blocks  plain einsums over 128-row query blocks, each against only the key
          blocks its window reaches: causality alone skips a quarter of the
          score and value matmuls at 256 positions, more at longer ones. On
          CPU, where XLA's attention computes and masks the whole square, it
          measured 3-5% of the whole train step (docs/performance.md).
  splash  the Pallas Splash attention kernel. Off TPU it runs in the Pallas
          interpreter: slow, for tests that check it against `xla`.

Query i sees keys i - window .. i. Splash takes one sequence and one kv head
at a time (its MQA form, the kv head's G query heads together), so it is
vmapped over batch and kv heads, and under a mesh it runs per shard
(`shard_map`: batch over the batch axes, kv heads over `tensor`), since a
Pallas call is not partitioned automatically.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bov_jax import sharding

IMPLS = ("auto", "xla", "blocks", "splash")
SPLASH_BLOCK = 128  # Splash's sequence blocks are multiples of 128 rows
CAUSAL_BLOCK = 128  # query rows per block of `blocks`


def splash_fits(seq_len: int) -> bool:
  return seq_len % SPLASH_BLOCK == 0


def resolve(impl: str, seq_len: int) -> str:
  """The kernel used for this length: sequences that do not fill the blocks
  (short evaluation buckets) take `xla` whatever the setting."""
  if impl == "auto":
    impl = {"tpu": "splash", "cpu": "blocks"}.get(jax.default_backend(), "xla")
  if impl == "splash" and splash_fits(seq_len):
    return "splash"
  if impl == "blocks" and seq_len % CAUSAL_BLOCK == 0 and seq_len > CAUSAL_BLOCK:
    return "blocks"
  return "xla"


def self_attend(q_BTHE, k_BTKE, v_BTKE, window: int, impl: str = "auto"):
  """Attention output [B, T, H * E]."""
  B, T, H, E = q_BTHE.shape
  kernel = resolve(impl, T)
  if kernel == "xla":
    out = jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, is_causal=True,
                                       local_window_size=(window, 0))
    return out.reshape(B, T, H * E)
  if kernel == "blocks":
    return _blocks(q_BTHE, k_BTKE, v_BTKE, window)
  return _splash_sharded(q_BTHE, k_BTKE, v_BTKE, window)


def _blocks(q_BTHE, k_BTKE, v_BTKE, window: int):
  """Each 128-row query block against only the key blocks its window reaches
  (autodiff gives the backward). Head-major once for all blocks: sliced
  token-major, each block's matmuls paid for their own layout copies (the
  step measured 1-2% slower)."""
  T = q_BTHE.shape[1]
  q, k, v = _heads_major(q_BTHE, k_BTKE, v_BTKE)
  c = CAUSAL_BLOCK
  out = []
  for a in range(0, T, c):
    lo = max(0, a - window) // c * c  # first key block the window reaches
    out.append(_attend_heads(q[:, :, :, a:a + c], k[:, :, lo:a + c], v[:, :, lo:a + c],
                             np.arange(a, a + c)[None], np.arange(lo, a + c)[None], window))
  return _tokens_major(jnp.concatenate(out, axis=3))


def attend(q_BTHE, k_BSKE, v_BSKE, qpos_BT, kpos_BS, window):
  """Causal sliding-window GQA attention [B, T, H * E]: query i sees key j iff
  0 <= i - j <= window.

  Positions are explicit so the same function serves cached decoding (S = cache
  length; an empty slot gets a position past every query, which the causal test
  hides).
  """
  return _tokens_major(_attend_heads(*_heads_major(q_BTHE, k_BSKE, v_BSKE), qpos_BT, kpos_BS,
                                    window))


def _heads_major(q_BTHE, k_BSKE, v_BSKE):
  """q [B, K, G, T, E] (query head h = kv head h // G), k and v [B, K, S, E]."""
  B, T, H, E = q_BTHE.shape
  K = k_BSKE.shape[2]
  q = q_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)
  return q, k_BSKE.transpose(0, 2, 1, 3), v_BSKE.transpose(0, 2, 1, 3)


def _tokens_major(out_BKGTE):
  """[B, K, G, T, E] -> [B, T, H * E], the inverse of `_heads_major` for q."""
  B, K, G, T, E = out_BKGTE.shape
  return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G * E)


def _attend_heads(q_BKGTE, k_BKSE, v_BKSE, qpos_BT, kpos_BS, window):
  E = q_BKGTE.shape[-1]
  scores = jnp.einsum("bkgte,bkse->bkgts", q_BKGTE, k_BKSE,
                      preferred_element_type=jnp.float32) / np.sqrt(E)
  delta = qpos_BT[:, :, None] - kpos_BS[:, None, :]  # [B, T, S]
  visible = (delta >= 0) & (delta <= window)
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BKSE.dtype)
  return jnp.einsum("bkgts,bkse->bkgte", probs, v_BKSE)


@functools.lru_cache(maxsize=None)
def _splash_kernel(seq_len: int, window: int, group: int, interpret: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  # Built from numpy masks once per shape; the kernel skips blocks the mask empties.
  mask = sa.MultiHeadMask([sa.LocalMask((seq_len, seq_len), (min(window, seq_len), 0), offset=0)
                           for _ in range(group)])
  block = math.gcd(seq_len, 512)
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  # Concrete mask tables even when first built inside a trace: the kernel is
  # cached and reused by later traces (a tracer kept here would leak).
  with jax.ensure_compile_time_eval():
    return sa.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def _splash(q_BTHE, k_BTKE, v_BTKE, window: int):
  B, T, H, E = q_BTHE.shape
  K = k_BTKE.shape[2]
  kernel = _splash_kernel(T, window, H // K, jax.default_backend() != "tpu")
  q = (q_BTHE / np.sqrt(E).astype(q_BTHE.dtype)).reshape(B, T, K, H // K, E)
  q_BKGTE = q.transpose(0, 2, 3, 1, 4)
  k_BKTE, v_BKTE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
  out_BKGTE = jax.vmap(jax.vmap(kernel))(q_BKGTE, k_BKTE, v_BKTE)
  return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H * E)


def _splash_sharded(q_BTHE, k_BTKE, v_BTKE, window: int):
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _splash(q_BTHE, k_BTKE, v_BTKE, window)
  B, K = q_BTHE.shape[0], k_BTKE.shape[2]
  batch = tuple(a for a in sharding.BATCH_AXES if mesh.shape[a] > 1)
  if B % math.prod(mesh.shape[a] for a in batch):
    batch = ()
  heads = "tensor" if mesh.shape["tensor"] > 1 and K % mesh.shape["tensor"] == 0 else None
  spec = P(batch or None, None, heads, None)
  return jax.shard_map(functools.partial(_splash, window=window), mesh=mesh,
                       in_specs=(spec, spec, spec), out_specs=P(batch or None, None, heads),
                       check_vma=False)(q_BTHE, k_BTKE, v_BTKE)
