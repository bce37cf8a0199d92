"""The model's weight matmul, x [..., D] @ w [D, F], with its CPU form.

On every backend the product is one 2-D matmul over flattened rows. On XLA's CPU
backend two things run faster (docs/performance.md, "CPU forms"):
the flattened [rows, D] operand itself (the backward's x^T dy), and, for a weight
with more rows than columns (the MLP's W_proj), a weight gradient formed
transposed behind an optimization barrier, so XLA cannot fold the transpose back
into a slower matmul. Elsewhere the plain product is left to the compiler.
"""

from __future__ import annotations

import jax


def mm(x, w, form: str = "plain"):
  """x [..., D] @ w [D, F] in x's dtype; form `cpu` (spec.ModelSpec.matmul) for XLA's
  CPU backend."""
  x2 = x.reshape(-1, x.shape[-1])
  w = w.astype(x.dtype)
  narrowing = w.shape[0] > w.shape[1] and form == "cpu"
  y = _mm_narrowing(x2, w) if narrowing else x2 @ w
  return y.reshape(*x.shape[:-1], w.shape[-1])


@jax.custom_vjp
def _mm_narrowing(x, w):
  return x @ w


def _mm_narrowing_fwd(x, w):
  return x @ w, (x, w)


def _mm_narrowing_bwd(res, dy):
  x, w = res
  return dy @ w.T, jax.lax.optimization_barrier(dy.T @ x).T


_mm_narrowing.defvjp(_mm_narrowing_fwd, _mm_narrowing_bwd)
