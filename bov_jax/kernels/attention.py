"""Causal sliding-window GQA attention: a sequence over itself (training, prefill) and
new queries over a cache (decoding).

`model.attention` picks the kernel (`auto` is resolved per backend in spec.py: Splash
on TPU, `blocks` on CPU, `cudnn` on GPU):
  xla     jax.nn.dot_product_attention's XLA implementation: the whole [T, T]
          score matrix, masked
  cudnn   jax.nn.dot_product_attention's cuDNN flash attention (sliding windows
          included); spec.py keeps it only on GPU with bf16/fp16 compute and head
          dims up to 128 that are multiples of 8. It must be asked for by name:
          jax.nn's default (implementation=None) is XLA's.
  blocks  plain einsums over 128-row query blocks, each against only the key
          blocks its window reaches: causality alone skips a quarter of the
          score and value matmuls at 256 positions, more at longer ones (on
          CPU, where XLA's attention computes and masks the whole square).
  splash  the Pallas Splash attention kernel, in `block`-row blocks. Built for
          another target than TPU (`interpret`) it runs in the Pallas
          interpreter: slow, for tests that check it against `xla`.

Query i sees keys i - window .. i. Splash takes one sequence and one kv head
at a time (its MQA form, the kv head's G query heads together), so it is
vmapped over batch and kv heads, and under a mesh it runs per shard
(`shard_map`: batch over the batch axes, kv heads over `tensor`), since a
Pallas call is not partitioned automatically.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bov_jax.parallel import sharding

CAUSAL_BLOCK = 128  # query rows per block of `blocks`
SPLASH_BLOCK = 128  # Splash attention's sequence blocks are multiples of 128 rows


def splash_fits(seq_len: int) -> bool:
  return seq_len % SPLASH_BLOCK == 0


def kernel_for(impl: str, seq_len: int) -> str:
  """The kernel the setting `impl` (resolved for the target, spec.py) runs at this
  length: sequences that do not fill the blocks (short evaluation buckets) take `xla`."""
  if impl == "splash" and splash_fits(seq_len):
    return "splash"
  if impl == "cudnn":
    return "cudnn"
  if impl == "blocks" and seq_len % CAUSAL_BLOCK == 0 and seq_len > CAUSAL_BLOCK:
    return "blocks"
  return "xla"


def self_attend(q_BTHE, k_BTKE, v_BTKE, window: int, impl: str = "xla", *,
                interpret: bool = False, block: int = 512):
  """Attention output [B, T, H * E]. interpret, block: Splash's (see the module doc)."""
  B, T, H, E = q_BTHE.shape
  kernel = kernel_for(impl, T)
  if kernel in ("xla", "cudnn"):
    out = jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, is_causal=True,
                                       local_window_size=(window, 0), implementation=kernel)
    return out.reshape(B, T, H * E)
  if kernel == "blocks":
    return _blocks(q_BTHE, k_BTKE, v_BTKE, window)
  return _splash_sharded(q_BTHE, k_BTKE, v_BTKE, window, interpret, block)


def _blocks(q_BTHE, k_BTKE, v_BTKE, window: int):
  """Each 128-row query block against only the key blocks its window reaches
  (autodiff gives the backward). Head-major once for all blocks: sliced
  token-major, each block's matmuls would pay for their own layout copies."""
  T = q_BTHE.shape[1]
  q = query_heads(q_BTHE, k_BTKE.shape[2])
  k, v = kv_rows(k_BTKE), kv_rows(v_BTKE)
  c = CAUSAL_BLOCK
  out = []
  for a in range(0, T, c):
    lo = max(0, a - window) // c * c  # first key block the window reaches
    out.append(_attend_heads(q[:, :, :, a:a + c], k[:, lo:a + c], v[:, lo:a + c],
                             np.arange(a, a + c)[None], np.arange(lo, a + c)[None], window))
  return tokens_major(jnp.concatenate(out, axis=3))


def attend(q_BTHE, k_NSE, v_NSE, qpos_BT, kpos_BS, window):
  """Causal sliding-window GQA attention [B, T, H * E] of T queries over S keys
  and values held as rows N = B * K (`kv_rows`): query i sees key j iff
  0 <= i - j <= window.

  This serves cached decoding: positions are explicit (S = cache length; an empty
  slot gets a position past every query, which the causal test hides), and the
  cache is kept in the layout the matmuls read: turning a token-major cache
  head-major on every step costs more than the attention itself
  (docs/performance.md, "CPU forms").
  """
  B = q_BTHE.shape[0]
  q_BKGTE = query_heads(q_BTHE, k_NSE.shape[0] // B)
  return tokens_major(_attend_heads(q_BKGTE, k_NSE, v_NSE, qpos_BT, kpos_BS, window))


def kv_rows(x_BSKE):
  """[B, S, K, E] -> [B * K, S, E]: one row per sequence and kv head, the layout
  `attend` takes keys and values in. One leading dimension, not (B, K): XLA
  drops a size-1 dimension of a matmul's batch (one sequence), and when that
  matmul read a cache updated in place in the same decode step, XLA copied the
  cache buffer twice per step."""
  B, S, K, E = x_BSKE.shape
  return x_BSKE.transpose(0, 2, 1, 3).reshape(B * K, S, E)


def query_heads(q_BTHE, K):
  """[B, T, H, E] -> [B, K, G, T, E]: query head h = kv head h // G."""
  B, T, H, E = q_BTHE.shape
  return q_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)


def tokens_major(out_BKGTE):
  """[B, K, G, T, E] -> [B, T, H * E], the inverse of `query_heads`."""
  B, K, G, T, E = out_BKGTE.shape
  return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G * E)


def _attend_heads(q_BKGTE, k_NSE, v_NSE, qpos_BT, kpos_BS, window):
  B, K, G, T, E = q_BKGTE.shape
  S = k_NSE.shape[1]
  delta = qpos_BT[:, :, None] - kpos_BS[:, None, :]  # [B, T, S]
  visible = (delta >= 0) & (delta <= window)
  visible_NMS = jnp.broadcast_to(visible[:, None, None], (B, K, G, T, S)).reshape(B * K, G * T, S)
  # The matmuls see one row dimension M = G * T (free reshapes): with two (g, t)
  # XLA's CPU dot takes a slower path (docs/performance.md, "CPU forms").
  out = _softmax_attention(q_BKGTE.reshape(B * K, G * T, E), k_NSE, v_NSE, visible_NMS)
  return out.reshape(B, K, G, T, E)


@jax.custom_vjp
def _softmax_attention(q_NME, k_NSE, v_NSE, visible_NMS):
  """softmax(q k^T / sqrt(E), where visible) v, rows N = B * K, queries M = G * T."""
  return _softmax_attention_fwd(q_NME, k_NSE, v_NSE, visible_NMS)[0]


def _softmax_attention_fwd(q_NME, k_NSE, v_NSE, visible_NMS):
  scores = jnp.einsum("nme,nse->nms", q_NME, k_NSE,
                      preferred_element_type=jnp.float32) / np.sqrt(q_NME.shape[-1])
  probs = jax.nn.softmax(jnp.where(visible_NMS, scores, -jnp.inf), axis=-1)
  out = jnp.einsum("nms,nse->nme", probs.astype(v_NSE.dtype), v_NSE)
  return out, (q_NME, k_NSE, v_NSE, probs, out)


def _softmax_attention_bwd(res, dout_NME):
  """The softmax's backward takes its row sum from dout . out, over E, as flash
  attention does (sum_s p_s dp_s = dout . sum_s p_s v_s), one pass over E
  instead of autodiff's sum of p * dp over S."""
  q_NME, k_NSE, v_NSE, probs, out = res
  dv = jnp.einsum("nms,nme->nse", probs.astype(v_NSE.dtype), dout_NME)
  dp = jnp.einsum("nme,nse->nms", dout_NME, v_NSE, preferred_element_type=jnp.float32)
  d = jnp.sum(dout_NME.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  ds = probs * (dp - d) / np.sqrt(q_NME.shape[-1])
  dq = jnp.einsum("nms,nse->nme", ds.astype(k_NSE.dtype), k_NSE).astype(q_NME.dtype)
  dk = jnp.einsum("nms,nme->nse", ds.astype(q_NME.dtype), q_NME).astype(k_NSE.dtype)
  return dq, dk, dv.astype(v_NSE.dtype), None


_softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


@functools.lru_cache(maxsize=None)
def _splash_kernel(seq_len: int, window: int, group: int, interpret: bool, block: int):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  # Built from numpy masks once per shape; the kernel skips blocks the mask empties.
  mask = sa.MultiHeadMask([sa.LocalMask((seq_len, seq_len), (min(window, seq_len), 0), offset=0)
                           for _ in range(group)])
  block = math.gcd(seq_len, block)
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  # Concrete mask tables even when first asked for inside a trace: the kernel is
  # cached and reused by later traces (a tracer kept here would leak). Built in a
  # thread of its own, so outside this thread's trace and mesh: a program built for
  # another target (`--mode=compile`) has a mesh of devices that run nothing.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(sa.make_splash_mqa, mask, block_sizes=sizes, head_shards=1,
                       q_seq_shards=1, interpret=interpret).result()


def _splash(q_BTHE, k_BTKE, v_BTKE, window: int, interpret: bool, block: int):
  B, T, H, E = q_BTHE.shape
  K = k_BTKE.shape[2]
  kernel = _splash_kernel(T, window, H // K, interpret, block)
  q = (q_BTHE / np.sqrt(E).astype(q_BTHE.dtype)).reshape(B, T, K, H // K, E)
  q_BKGTE = q.transpose(0, 2, 3, 1, 4)
  k_BKTE, v_BKTE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
  out_BKGTE = jax.vmap(jax.vmap(kernel))(q_BKGTE, k_BKTE, v_BKTE)
  return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H * E)


def _splash_sharded(q_BTHE, k_BTKE, v_BTKE, window: int, interpret: bool, block: int):
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _splash(q_BTHE, k_BTKE, v_BTKE, window, interpret, block)
  B, K = q_BTHE.shape[0], k_BTKE.shape[2]
  batch = sharding.batch_axes(mesh, B)
  heads = "tensor" if mesh.shape["tensor"] > 1 and K % mesh.shape["tensor"] == 0 else None
  spec = P(batch or None, None, heads, None)
  return jax.shard_map(functools.partial(_splash, window=window, interpret=interpret,
                                         block=block), mesh=mesh,
                       in_specs=(spec, spec, spec), out_specs=P(batch or None, None, heads),
                       axis_names=sharding.free_axes(mesh), check_vma=False)(q_BTHE, k_BTKE,
                                                                             v_BTKE)
