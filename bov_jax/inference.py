"""Text generation.

`generate_uncached` recomputes the full forward pass for every new token (the
slow reference path): one jitted function over a fixed [B, T] buffer, so it
compiles once whatever the prompt length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_logits(logits_BV, key, temperature: float, top_k: int):
  """Greedy when temperature == 0; else temperature and optional top-k sampling."""
  if temperature <= 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  z = logits_BV / temperature
  if top_k and top_k > 0:
    kth = jax.lax.top_k(z, top_k)[0][..., -1:]
    z = jnp.where(z < kth, -jnp.inf, z)
  return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)


def generate_uncached(graphdef, params, prompt_ids, max_new_tokens: int, context: int,
                      temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
  """Generates up to max_new_tokens after one prompt, recomputing the whole prefix each step."""
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
  for pos in range(n_prompt, total):
    key, sub = jax.random.split(key)
    tok = next_token(params, buf, pos, sub)
    buf = buf.at[0, pos].set(tok[0])
    out.append(int(tok[0]))
  return out
