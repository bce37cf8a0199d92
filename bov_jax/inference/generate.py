"""Text generation: one prefill pass, then a `lax.fori_loop` of decode steps over the
cache (kvcache.py), so nothing recompiles per step and nothing returns to the host.

`generate` takes a batch of prompts of different lengths; `stream` gives the same tokens a
chunk of decode steps at a time (stop strings are checked between chunks);
`generate_cached` one prompt; `generate_uncached` recomputes the whole forward pass per
token (the slow reference path, `sample.use_cache=false`), and the two give the same
tokens.
`tables_to_host` keeps the value tables in host memory and moves only the rows a
step reads (`sample.tables_on_host`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.inference.sampling import sample_logits
from bov_jax.model import gpt as model_lib
from bov_jax.model import kvcache
from bov_jax.parallel import lookup


def tables_to_host(params):
  """The parameters with the value tables in host memory, for a model whose spec keeps
  them there (`tables_on_host`: the run spec's `sample_model`, whose settings spec.check
  has checked), read row by row."""
  params = dict(params)
  params["tables"] = {k: lookup.place_on_host(v) for k, v in params.get("tables", {}).items()}
  return params


def prompt_too_long(prompt_len: int, context: int) -> str | None:
  """Why sample.prompt cannot be continued in `context` positions, or None when it can."""
  if prompt_len < context:
    return None
  return f"sample.prompt is {prompt_len} tokens, the context is {context}"


def cache_length(prompt_len: int, max_new_tokens: int, multiple: int = 128) -> int:
  """Cache positions a generation can reach (the last sampled token is not run),
  rounded up to a multiple."""
  return -(-(prompt_len + max_new_tokens) // multiple) * multiple


def prefill(model, prompts_BP, lengths_B, context: int):
  """Runs right-padded prompts of different lengths in one pass into a new cache of
  `context` positions. Returns (each sequence's last logits [B, V], the cache rewound
  to each sequence's real length)."""
  B, P = prompts_BP.shape
  h_BPD, cache = model.hidden(prompts_BP, kvcache.init(model, B, context))
  # the cache holds the padding too: rewind each sequence to its real length
  lengths_B = lengths_B.astype(jnp.int32)
  cache["pos"] = lengths_B
  pre = model_lib.rmsnorm(model.wte[...].astype(model.compute_dtype)[prompts_BP])
  cache["prev"] = jnp.take_along_axis(pre, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  last_BD = jnp.take_along_axis(h_BPD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  return model.logits(last_BD), cache  # the head at each prompt's end only


def extend(model, ids_BC, cache):
  """C more tokens of every sequence into the cache at its positions (a chunk of a
  prefill): (the last one's logits [B, V], cache)."""
  h_BCD, cache = model.hidden(ids_BC, cache)
  return model.logits(h_BCD[:, -1]), cache


def decode_step(model, last_BV, cache, key, temperature: float = 0.0, top_k: int = 0):
  """One token per sequence chosen from the last logits and run: (tokens [B], their
  logits [B, V], cache)."""
  tok = sample_logits(last_BV, key, temperature, top_k, model.spec.sampler)
  logits, cache = model(tok[:, None], cache)
  return tok, logits[:, 0], cache


def decode(model, last_BV, cache, key, n: int, temperature: float = 0.0, top_k: int = 0,
           first: int | jax.Array = 0):
  """n tokens per sequence, one decode step each inside a fori_loop; the t-th drawn with
  fold_in(key, first + t), so a generation decoded in chunks (`stream`) draws what one
  decoded whole draws. Returns ([B, n] ids, the last logits, cache)."""
  out = jnp.zeros((last_BV.shape[0], n), jnp.int32)

  def body(t, carry):
    last, cache, out = carry
    tok, last, cache = decode_step(model, last, cache, jax.random.fold_in(key, first + t),
                                   temperature, top_k)
    return last, cache, out.at[:, t].set(tok)

  last, cache, out = jax.lax.fori_loop(0, n, body, (last_BV, cache, out))
  return out, last, cache


@functools.partial(jax.jit, static_argnames=("graphdef", "context", "max_new_tokens",
                                             "temperature", "top_k"))
def generate(graphdef, params, prompts_BP, lengths_B, key, *, context: int,
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0):
  """Batched prompts of different lengths (right-padded) -> [B, max_new_tokens] new ids.

  The cache holds the positions the generation can reach, P + max_new_tokens rounded
  up to 128 (the fused kernels' blocks), not the whole context: every decode step
  reads each layer's cache, so a short prompt at a long context reads a fraction of it.
  """
  model = nnx.merge(graphdef, params)
  P = prompts_BP.shape[1]
  last, cache = prefill(model, prompts_BP, lengths_B,
                        min(context, cache_length(P, max_new_tokens)))
  return decode(model, last, cache, key, max_new_tokens, temperature, top_k)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "context"))
def _prefill(graphdef, params, prompts_BP, lengths_B, *, context: int):
  return prefill(nnx.merge(graphdef, params), prompts_BP, lengths_B, context)


@functools.partial(jax.jit, static_argnames=("graphdef", "n", "temperature", "top_k"),
                   donate_argnames=("cache",))
def _decode(graphdef, params, last_BV, cache, key, first, *, n: int, temperature: float,
            top_k: int):
  return decode(nnx.merge(graphdef, params), last_BV, cache, key, n, temperature, top_k, first)


def stream(graphdef, params, prompts_BP, lengths_B, key, *, context: int, max_new_tokens: int,
           chunk: int = 32, temperature: float = 0.0, top_k: int = 0):
  """`generate`'s tokens, `chunk` steps at a time ([B, chunk] numpy arrays, the last one
  cut to max_new_tokens), so a caller can stop early (a stop string, say) between chunks;
  two programs (prefill, a chunk of decode steps over the donated cache), whatever the
  number of chunks."""
  P = prompts_BP.shape[1]
  steps = -(-max_new_tokens // chunk) * chunk  # the last chunk runs whole; its tail is dropped
  last, cache = _prefill(graphdef, params, prompts_BP, lengths_B,
                         context=min(context, cache_length(P, steps)))
  for first in range(0, max_new_tokens, chunk):
    out, last, cache = _decode(graphdef, params, last, cache, key, jnp.int32(first), n=chunk,
                               temperature=temperature, top_k=top_k)
    yield np.asarray(out)[:, :max_new_tokens - first]


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
    model = nnx.merge(graphdef, params)
    logits = model(buf)  # [1, T, V]
    last = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)
    return sample_logits(last, key, temperature, top_k, model.spec.sampler)

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
