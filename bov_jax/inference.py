"""Decoding with a cache that keeps no values for bank layers (SPEC section 7).

The cache, per sequence of the batch, up to `context` positions:
  k[i]    keys of every layer i, a row per sequence and kv head   [B * K, S, E]
          (`attention.kv_rows`: the layout attention's matmuls read)
  v[i]    values, only for layers whose values depend on context: a bank layer
          (table, replace) stores none and gathers gamma * E_i[ids] when it runs;
          a V1-replace layer reuses layer 0's values instead of storing them again
  ids     the token ids, once for the whole model (only when a bank layer exists)
  prev    the previous token's pre-smear embedding (the smear gate needs it)
  pos     how many positions each sequence holds

Prefill runs the prompt in one pass; decode adds one token per step inside a
`lax.fori_loop`, so nothing recompiles per step and nothing returns to the host.
A decode step of a sliding-window layer reads only its window of the cache
(`_window`); a bank layer's can gather inside the attention kernel
(`bank_decode`, `model.decode_attention`).
`generate_uncached` recomputes the whole forward pass per token (the slow
reference path, `use_cache=false`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax import attention
from bov_jax import bank_decode
from bov_jax import model as model_lib
from bov_jax import sharding
from bov_jax import values


def tables_to_host(cfg, params):
  """(graphdef, params) with the value tables in host memory, read row by row.

  Raises ConfigError naming `sample.tables_on_host` where the backend has no
  host memory kind or the run spans several devices.
  """
  from bov_jax import config as config_lib
  if not sharding.host_memory_supported():
    raise config_lib.ConfigError(
        f"sample.tables_on_host=True is not supported on this backend "
        f"({jax.default_backend()}): its devices have no pinned_host memory")
  devices = {d for x in jax.tree.leaves(params) for d in getattr(x, "sharding").device_set}
  if len(devices) > 1:
    raise config_lib.ConfigError(
        "sample.tables_on_host=True is supported for a model on a single device; this "
        f"one spans {len(devices)}")
  c = cfg.copy_and_resolve_references()
  c.model.table_lookup = "host"
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.build(c)))
  params = dict(params)
  params["tables"] = {k: sharding.place_on_host(v) for k, v in params.get("tables", {}).items()}
  return graphdef, params


# -- which layers store what ----------------------------------------------------------

def stores_values(lv: values.LayerValue) -> bool:
  """A layer keeps values unless they are a function of ids (bank) or of layer 0's."""
  return not (lv.target and lv.combine == "replace" and lv.source in ("table", "v1"))


def bank_layers(model) -> list[int]:
  return [i for i, lv in enumerate(model.plan)
          if lv.target and lv.combine == "replace" and lv.source == "table"]


def init_cache(model, batch: int, context: int) -> dict:
  a = model.blocks[0].attn
  K, E = a.n_kv_head, a.head_dim
  D = model.wte.shape[1]
  dt = model.compute_dtype
  cache = {
      "k": [jnp.zeros((batch * K, context, E), dt) for _ in model.blocks],
      "v": {str(i): jnp.zeros((batch * K, context, E), dt)
            for i, lv in enumerate(model.plan) if stores_values(lv)},
      "prev": jnp.zeros((batch, D), dt),
      "pos": jnp.zeros((batch,), jnp.int32),
  }
  if bank_layers(model):
    cache["ids"] = jnp.zeros((batch, context), jnp.int32)
  return cache


def cache_bytes(cache: dict) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def _cached_values(model, i, cache, rows=lambda x: x, seqs=lambda x: x):
  """Values of the cached positions for layer i (bank and V1 layers rebuild them).
  `rows` and `seqs` cut a [B * K, S, E] buffer and the [B, S] ids to the positions
  attention reads (all of them, or a sliding window's: `_window`)."""
  lv, attn = model.plan[i], model.blocks[i].attn
  if stores_values(lv):
    return rows(cache["v"][str(i)])
  coeffs = {n: p[...] for n, p in attn.coeffs.items()}
  if lv.source == "v1":
    return values.combine(lv, None, rows(cache["v"]["0"]), coeffs)
  ids = seqs(cache["ids"])
  B, S = ids.shape
  vals = sharding.table_lookup(model.tables[model.table_of[i]][...], ids, model.table_lookup)
  vals = vals.astype(model.compute_dtype).reshape(B, S, attn.n_kv_head, attn.head_dim)
  # XLA writes the gathered rows straight into the layout attention reads (the
  # transpose folds into the gather): a bank layer pays one extra pass over
  # its rows against a stored-value layer.
  return values.combine(lv, None, attention.kv_rows(vals), coeffs)


def _window(window: int, start_B, S: int, K: int):
  """For one decode step of a sliding-window layer: (rows, seqs, kpos_BW) cutting
  the cache to the W = window + 1 positions each query can see, or None where the
  window covers more than half the cache (cutting copies W positions, so it pays
  only when it skips more than it copies). At 4,096 positions a layer with the
  reference's 1,024 window reads a quarter of its keys and values, and a bank
  layer gathers a quarter of its rows."""
  W = window + 1
  if 2 * W > S:
    return None
  lo_B = jnp.clip(start_B - window, 0, S - W)  # the W positions hold start - window .. start
  lo_N = jnp.repeat(lo_B, K)
  cut = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, W, axis=0))
  return (lambda x: cut(x, lo_N), lambda x: cut(x, lo_B),
          lo_B[:, None] + jnp.arange(W)[None, :])


def _fused_bank(model, i, batch, context) -> bool:
  """Whether layer i's decode step runs `bank_decode`'s kernel (a bank layer whose
  gather it fuses; `model.decode_attention`)."""
  if i not in bank_layers(model):
    return False
  a, table = model.blocks[i].attn, model.tables[model.table_of[i]]
  return bank_decode.resolve(model.decode_attention, context, a.head_dim, model.table_lookup,
                             batch, table.shape[0], n_kv_head=a.n_kv_head,
                             group=a.n_head // a.n_kv_head, window=a.window,
                             dtype=model.compute_dtype, table_dtype=table.dtype) == "fused"


def _write(buf, new, start):
  """buf[n, start[n]:start[n]+T] = new[n] for every row n."""
  return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0))(
      buf, new, start)


def forward_cached(model, idx_BT, cache):
  """Runs T new tokens per sequence at positions pos..pos+T-1 against the cache.

  Returns (logits [B, T, V] fp32, new cache). With an empty cache this is the
  prefill; with T = 1 it is one decode step.
  """
  B, T = idx_BT.shape
  start = cache["pos"]
  pos = start[:, None] + jnp.arange(T)[None, :]
  prev = jnp.where((start > 0)[:, None], cache["prev"], 0)
  x, last_pre = model.embed(idx_BT, prev_BD=prev)
  cache = dict(cache, k=list(cache["k"]), v=dict(cache["v"]))
  if "ids" in cache:
    cache["ids"] = _write(cache["ids"], idx_BT.astype(jnp.int32), start)
  x0n = model_lib.rmsnorm(x)
  S = cache["k"][0].shape[1]
  start_N = jnp.repeat(start, model.blocks[0].attn.n_kv_head)  # each kv-head row's sequence
  kpos = jnp.broadcast_to(jnp.arange(S), (B, S))
  cs = model_lib.rope(pos, model.blocks[0].attn.head_dim)
  v1_new = None
  for i, block in enumerate(model.blocks):
    q, k, v = block.attn.qkv(model_lib.rmsnorm(x), cs, model.v_tilde(i, x0n, v1_new, idx_BT))
    if i == 0:
      v1_new = v
    cache["k"][i] = _write(cache["k"][i], attention.kv_rows(k), start_N)
    if stores_values(model.plan[i]):
      cache["v"][str(i)] = _write(cache["v"][str(i)], attention.kv_rows(v), start_N)
    if T == 1 and _fused_bank(model, i, B, S):
      coeffs = block.attn.coeffs
      y = bank_decode.attend(q, cache["k"][i], cache["ids"], model.tables[model.table_of[i]][...],
                             start, block.attn.window,
                             coeffs["gamma"][...] if "gamma" in coeffs else None)
    else:
      cut = _window(block.attn.window, start, S, block.attn.n_kv_head) if T == 1 else None
      rows, seqs, kp = cut or (lambda x: x, lambda x: x, kpos)
      y = attention.attend(q, rows(cache["k"][i]), _cached_values(model, i, cache, rows, seqs),
                           pos, kp, block.attn.window)
    x = x + block.attn.output(y)
    x = x + block.mlp(model_lib.rmsnorm(x))
  logits = model.logits(model_lib.rmsnorm(x))
  cache["prev"] = last_pre
  cache["pos"] = start + T
  return logits, cache


# Token choice by hand: on XLA's CPU backend jnp.argmax, lax.top_k and
# jax.random.categorical cost more than a decode step of a small model (at a
# 65,536 vocabulary, per token: 292, 11,085 and 1,717 us against 65, 422 and 204
# for the forms below; docs/performance.md). The choices are the same, except
# which token a given key samples.

def greedy(logits_BV):
  """jnp.argmax (the first index of the largest logit) as two plain reductions:
  argmax's paired (value, index) reduction runs unvectorised. A NaN row gives
  the last index."""
  V = logits_BV.shape[-1]
  top = jnp.max(logits_BV, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
  return jnp.minimum(jnp.min(jnp.where(logits_BV == top, index, V), axis=-1), V - 1)


def _sortable(x):
  """float32 -> uint32 keys in the same order (negatives: all bits flipped)."""
  b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(b >> 31 == 1, ~b, b | np.uint32(0x80000000))


def top_k_mask(z_BV, k: int):
  """True for each row's k largest entries and any tied with the k-th, as with
  lax.top_k's k-th value for threshold. The threshold is the largest key t with at
  least k keys >= t, found bit by bit from the top (32 counting passes; top_k
  sorts the row)."""
  keys = _sortable(z_BV)

  def bit(i, t):
    cand = t | jax.lax.shift_left(np.uint32(1), (31 - i).astype(jnp.uint32))
    enough = jnp.sum(keys >= cand, axis=-1, keepdims=True) >= k
    return jnp.where(enough, cand, t)
  return keys >= jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:-1] + (1,), jnp.uint32))


def sample_softmax(z_BV, key):
  """One token per row with probability softmax(z), by the inverse of its CDF and
  one uniform number per row (categorical draws a Gumbel number per entry)."""
  cdf = jnp.cumsum(jnp.exp(z_BV - jnp.max(z_BV, axis=-1, keepdims=True)), axis=-1)
  u = jax.random.uniform(key, z_BV.shape[:-1] + (1,)) * cdf[..., -1:]
  return jnp.minimum(jnp.sum(cdf <= u, axis=-1), z_BV.shape[-1] - 1).astype(jnp.int32)


def sample_logits(logits_BV, key, temperature: float, top_k: int):
  """Greedy when temperature == 0; else temperature and optional top-k sampling
  (the k largest logits, and any tied with the k-th)."""
  if temperature <= 0:
    return greedy(logits_BV)
  z = logits_BV.astype(jnp.float32) / temperature
  if top_k and top_k > 0:
    z = jnp.where(top_k_mask(z, top_k), z, -jnp.inf)
  return sample_softmax(z, key)


def cache_length(prompt_len: int, max_new_tokens: int, multiple: int = 128) -> int:
  """Cache positions a generation can reach (the last sampled token is not run),
  rounded up to a multiple."""
  return -(-(prompt_len + max_new_tokens) // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("graphdef", "context", "max_new_tokens",
                                             "temperature", "top_k"))
def generate(graphdef, params, prompts_BP, lengths_B, key, *, context: int,
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0):
  """Batched prompts of different lengths (right-padded) -> [B, max_new_tokens] new ids.

  One prefill pass over the padded prompts, then a fori_loop of decode steps;
  each sequence continues from its own length. The cache holds the positions the
  generation can reach, P + max_new_tokens rounded up to 128 (`bank_decode`'s
  blocks), not the whole context: every decode step reads each layer's cache, so
  a short prompt at a long context reads a fraction of it.
  """
  model = nnx.merge(graphdef, params)
  B, P = prompts_BP.shape
  cache = init_cache(model, B, min(context, cache_length(P, max_new_tokens)))
  logits, cache = forward_cached(model, prompts_BP, cache)
  # the cache holds the padding too: rewind each sequence to its real length
  lengths_B = lengths_B.astype(jnp.int32)
  cache["pos"] = lengths_B
  pre = model_lib.rmsnorm(model.wte[...].astype(model.compute_dtype)[prompts_BP])
  cache["prev"] = jnp.take_along_axis(pre, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  last = jnp.take_along_axis(logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  out = jnp.zeros((B, max_new_tokens), jnp.int32)

  def body(t, carry):
    last, cache, out = carry
    tok = sample_logits(last, jax.random.fold_in(key, t), temperature, top_k)
    out = out.at[:, t].set(tok)
    logits, cache = forward_cached(model, tok[:, None], cache)
    return logits[:, 0], cache, out

  _, _, out = jax.lax.fori_loop(0, max_new_tokens, body, (last, cache, out))
  return out


def generate_uncached(graphdef, params, prompt_ids, max_new_tokens: int, context: int,
                      temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
  """One prompt, recomputing the whole prefix each step: one jitted function over a
  fixed [1, context] buffer, so it compiles once whatever the prompt length."""
  n_prompt = len(prompt_ids)
  total = min(context, n_prompt + max_new_tokens)
  buf = np.zeros((1, context), np.int32)
  buf[0, :n_prompt] = prompt_ids

  @jax.jit
  def next_token(params, buf, pos, key):
    logits = nnx.merge(graphdef, params)(buf)  # [1, T, V]
    last = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)
    return sample_logits(last, key, temperature, top_k)

  key = jax.random.key(seed)
  out = []
  buf = jnp.asarray(buf)
  for step, pos in enumerate(range(n_prompt, total)):
    tok = next_token(params, buf, pos, jax.random.fold_in(key, step))
    buf = buf.at[0, pos].set(tok[0])
    out.append(int(tok[0]))
  return out


def generate_cached(graphdef, params, prompt_ids, max_new_tokens: int, context: int,
                    temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
  """One prompt through the cached path; the same sampling keys as generate_uncached."""
  n = min(max_new_tokens, context - len(prompt_ids))
  prompts = jnp.asarray([prompt_ids], jnp.int32)
  out = generate(graphdef, params, prompts, jnp.asarray([len(prompt_ids)]), jax.random.key(seed),
                 context=context, max_new_tokens=n, temperature=temperature, top_k=top_k)
  return [int(t) for t in np.asarray(out)[0]]
