"""Choosing the next token from logits: greedy, or temperature with optional top-k (the
primitives, in each backend's form, are kernels/sampling.py's)."""

from __future__ import annotations

import jax.numpy as jnp

from bov_jax.kernels import sampling as choice


def sample_logits(logits_BV, key, temperature: float, top_k: int, form: str = "jax"):
  """Greedy when temperature == 0; else temperature and optional top-k sampling
  (the k largest logits, and any tied with the k-th)."""
  if temperature <= 0:
    return choice.greedy(logits_BV, form)
  z = logits_BV.astype(jnp.float32) / temperature
  if top_k and top_k > 0:
    z = jnp.where(choice.top_k_mask(z, top_k, form), z, -jnp.inf)
  return choice.sample_softmax(z, key, form)
