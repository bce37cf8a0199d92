"""The decoding cache, and one layer's attention of new tokens over it (the paper,
Section 5: inference without a value cache for bank layers).

The cache, per sequence of the batch, up to `context` positions:
  k[i]    keys of every layer i, a row per sequence and kv head   [B * K, S, E]
          (`attention.kv_rows`: the layout attention's matmuls read)
  v[i]    values, only for layers that compute their own (`LayerValue.computes_v`):
          a bank layer stores none and gathers gamma * E_i[ids] when it runs; a
          V1-replace layer reads layer 0's values instead of storing them again
  ids     the token ids, once for the whole model (only when a bank layer exists)
  prev    the previous token's pre-smear embedding (the smear gate needs it)
  pos     how many positions each sequence holds

The model's one forward (`GPT.__call__` with a cache) calls `begin`, then `attend`
in every layer, then `end`. A decode step (one new token) of a sliding-window
layer reads only its window of the cache (`_window`); a bank layer's can gather
inside the attention kernel (`kernels/bank_decode.py`, `model.decode_attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bov_jax import sharding
from bov_jax import values
from bov_jax.kernels import attention
from bov_jax.kernels import bank_decode


def init(model, batch: int, context: int) -> dict:
  """An empty cache for `batch` sequences of up to `context` positions."""
  s = model.spec
  K, E = s.n_kv_head, s.head_dim
  dt = model.compute_dtype
  cache = {
      "k": [jnp.zeros((batch * K, context, E), dt) for _ in range(s.n_layer)],
      "v": {str(i): jnp.zeros((batch * K, context, E), dt)
            for i, lv in enumerate(s.layers) if lv.computes_v},
      "prev": jnp.zeros((batch, s.n_embd), dt),
      "pos": jnp.zeros((batch,), jnp.int32),
  }
  if any(lv.is_bank for lv in s.layers):
    cache["ids"] = jnp.zeros((batch, context), jnp.int32)
  return cache


def nbytes(cache: dict) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def _write(buf, new, start):
  """buf[n, start[n]:start[n]+T] = new[n] for every row n."""
  return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0))(
      buf, new, start)


def begin(cache, idx_BT):
  """(a copy of the cache holding the new ids, their positions [B, T], the pre-smear
  embedding before each sequence's first new token or 0 where there is none)."""
  start = cache["pos"]
  cache = dict(cache, k=list(cache["k"]), v=dict(cache["v"]))
  if "ids" in cache:
    cache["ids"] = _write(cache["ids"], idx_BT.astype(jnp.int32), start)
  pos = start[:, None] + jnp.arange(idx_BT.shape[1])[None, :]
  return cache, pos, jnp.where((start > 0)[:, None], cache["prev"], 0)


def end(cache, last_pre_BD, T: int):
  """The cache after all layers ran T new tokens (last_pre: the last one's pre-smear
  embedding)."""
  return dict(cache, prev=last_pre_BD, pos=cache["pos"] + T)


def _values(attn, cache, table, rows, seqs):
  """Values of the cached positions for a layer (bank and V1 layers rebuild them).
  `rows` and `seqs` cut a [B * K, S, E] buffer and the [B, S] ids to the positions
  attention reads (all of them, or a sliding window's: `_window`)."""
  lv = attn.lv
  if lv.computes_v:
    return rows(cache["v"][str(attn.index)])
  if lv.source == "v1":
    return values.combine(lv, None, rows(cache["v"]["0"]), attn.coefficients())
  ids = seqs(cache["ids"])
  B, S = ids.shape
  vals = sharding.table_lookup(table, ids, attn.table_lookup)
  vals = vals.astype(cache["k"][0].dtype).reshape(B, S, attn.n_kv_head, attn.head_dim)
  # XLA writes the gathered rows straight into the layout attention reads (the
  # transpose folds into the gather).
  return values.combine(lv, None, attention.kv_rows(vals), attn.coefficients())


def _window(window: int, start_B, S: int, K: int):
  """For one decode step of a sliding-window layer: (rows, seqs, kpos_BW) cutting
  the cache to the W = window + 1 positions each query can see, or None where the
  window covers more than half the cache (cutting copies W positions, so it pays
  only when it skips more than it copies)."""
  W = window + 1
  if 2 * W > S:
    return None
  lo_B = jnp.clip(start_B - window, 0, S - W)  # the W positions hold start - window .. start
  lo_N = jnp.repeat(lo_B, K)
  cut = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, W, axis=0))
  return (lambda x: cut(x, lo_N), lambda x: cut(x, lo_B),
          lo_B[:, None] + jnp.arange(W)[None, :])


def fused_bank(attn, batch: int, context: int, table, dtype) -> bool:
  """Whether this layer's decode step runs `bank_decode`'s kernel (a bank layer whose
  gather it fuses; `model.decode_attention`)."""
  if not attn.lv.is_bank:
    return False
  return bank_decode.kernel_for(
      attn.decode_kernel, context, attn.head_dim, attn.table_lookup, batch, table.shape[0],
      n_kv_head=attn.n_kv_head, group=attn.n_head // attn.n_kv_head, window=attn.window,
      dtype=dtype, table_dtype=table.dtype) == "fused"


def attend(attn, q_BTHE, k_BTKE, v_BTKE, cache, table=None):
  """Layer `attn.index`'s attention [B, T, H * E] of T new positions per sequence over
  the cache, after writing their keys (and values, where the layer keeps them).
  Returns (output, cache)."""
  i, K = attn.index, attn.n_kv_head
  B, T = q_BTHE.shape[:2]
  start = cache["pos"]
  start_N = jnp.repeat(start, K)  # each kv-head row's sequence
  cache["k"][i] = _write(cache["k"][i], attention.kv_rows(k_BTKE), start_N)
  if attn.lv.computes_v:
    cache["v"][str(i)] = _write(cache["v"][str(i)], attention.kv_rows(v_BTKE), start_N)
  S = cache["k"][i].shape[1]
  if T == 1 and fused_bank(attn, B, S, table, q_BTHE.dtype):
    coeffs = attn.coefficients()
    y = bank_decode.attend(q_BTHE, cache["k"][i], cache["ids"], table, start, attn.window,
                           coeffs.get("gamma"))
    return y, cache
  cut = _window(attn.window, start, S, K) if T == 1 else None
  rows, seqs, kpos = cut or (lambda x: x, lambda x: x, jnp.broadcast_to(jnp.arange(S), (B, S)))
  pos = start[:, None] + jnp.arange(T)[None, :]
  y = attention.attend(q_BTHE, rows(cache["k"][i]), _values(attn, cache, table, rows, seqs),
                       pos, kpos, attn.window)
  return y, cache
