"""The token-choice primitives in two forms: jax's own, and hand-written ones for XLA's CPU
backend.

On XLA's CPU backend jnp.argmax, lax.top_k and jax.random.categorical each cost
more than a decode step of a small model (docs/performance.md, "CPU forms"), so
there (form `cpu`, spec.ModelSpec.sampler) the choices are made by hand-written
forms that pick the same tokens (greedy, the top-k set); sampling by the inverse
CDF draws a different token for a given key than categorical's Gumbel draw, with
the same distribution. Other backends (form `jax`) use jax's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def greedy(logits_BV, form: str = "jax"):
  """The first index of each row's largest logit."""
  if form != "cpu":
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  # two plain reductions: argmax's paired (value, index) reduction runs unvectorised
  # on CPU. A NaN row gives the last index.
  V = logits_BV.shape[-1]
  top = jnp.max(logits_BV, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
  return jnp.minimum(jnp.min(jnp.where(logits_BV == top, index, V), axis=-1), V - 1)


def _sortable(x):
  """float32 -> uint32 keys in the same order (negatives: all bits flipped)."""
  b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(b >> 31 == 1, ~b, b | np.uint32(0x80000000))


def top_k_mask(z_BV, k: int, form: str = "jax"):
  """True for each row's k largest entries and any tied with the k-th."""
  if form != "cpu":
    return z_BV >= jax.lax.top_k(z_BV, k)[0][..., -1:]
  # the threshold is the largest key t with at least k keys >= t, found bit by bit
  # from the top (32 counting passes; top_k sorts the row)
  keys = _sortable(z_BV)

  def bit(i, t):
    cand = t | jax.lax.shift_left(np.uint32(1), (31 - i).astype(jnp.uint32))
    enough = jnp.sum(keys >= cand, axis=-1, keepdims=True) >= k
    return jnp.where(enough, cand, t)
  return keys >= jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:-1] + (1,), jnp.uint32))


def sample_softmax(z_BV, key, form: str = "jax"):
  """One token per row with probability softmax(z)."""
  if form != "cpu":
    return jax.random.categorical(key, z_BV, axis=-1).astype(jnp.int32)
  # the inverse of the CDF at one uniform number per row (categorical draws a Gumbel
  # number per entry)
  cdf = jnp.cumsum(jnp.exp(z_BV - jnp.max(z_BV, axis=-1, keepdims=True)), axis=-1)
  u = jax.random.uniform(key, z_BV.shape[:-1] + (1,)) * cdf[..., -1:]
  return jnp.minimum(jnp.sum(cdf <= u, axis=-1), z_BV.shape[-1] - 1).astype(jnp.int32)
