"""Polar Express (Muon's orthogonalisation, the reference's five steps) in two forms: the
direct iteration, and for matrices of aspect >= 1.5 the Gram-space form, which XLA's CPU
backend runs in fewer FLOPs (optim.polar_gram, resolved by the run spec)."""

from __future__ import annotations

import jax.numpy as jnp

POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(u, dtype=jnp.float32, gram: bool = True):
  """Approximate orthogonalisation (polar factor) of a matrix, 5 Polar Express steps,
  returned as float32.

  dtype: X's dtype between steps and the matmul operands' (the reference: bfloat16).
  Products are accumulated and combined in float32: at least the reference's
  precision (it rounds every product to bfloat16), and the fastest of XLA's CPU
  matmuls (docs/performance.md).
  gram: matrices of aspect >= 1.5 take the Gram-space form (fewer FLOPs;
  `_polar_express_gram`; its accuracy: docs/design.md, "Optimizer").
  """
  x = u.astype(jnp.float32)
  x = (x / (jnp.linalg.norm(x) * 1.01 + 1e-6)).astype(dtype)
  mm = lambda a, b: jnp.matmul(a.astype(dtype), b.astype(dtype),
                               preferred_element_type=jnp.float32)
  tall = x.shape[0] > x.shape[1]
  small, large = sorted(x.shape)
  if gram and 2 * large >= 3 * small:
    return _polar_express_gram(x, tall, mm)
  # Iterate on the smaller Gram matrix. For a tall matrix this is the transposed
  # iteration written without transposes (X^T X is symmetric): transposing X
  # and back costs XLA's CPU backend a layout copy per step.
  for a, b, c in POLAR_EXPRESS:
    if tall:
      A = mm(x.T, x)
      x = a * x.astype(jnp.float32) + mm(x, b * A + c * mm(A, A))
    else:
      A = mm(x, x.T)
      x = a * x.astype(jnp.float32) + mm(b * A + c * mm(A, A), x)
    x = x.astype(dtype)
  return x.astype(jnp.float32)


def _polar_express_gram(x, tall, mm):
  """The same five steps computed in the small Gram space, in float32; only the two
  products with X (`mm`, X's dtype for operands) see X's precision.

  Each step is X <- X p(A) with A = X^T X (tall X; mirrored for wide) and
  p(A) = a + b A + c A^2. Everything is a polynomial in G = X0^T X0, so these
  commute: X_k = X0 Q_k with Q_{k+1} = Q_k p(A_k), and A_{k+1} = p(A_k) A_k p(A_k).
  For an s x L matrix that is 17 s^3 matmuls plus two s^2 L ones instead of
  five times (two s^2 L + one s^3), fewer FLOPs at the MLP's 4:1. The Gram
  space is always float32, where squaring the condition number is harmless.
  """
  gram = mm(x.T, x) if tall else mm(x, x.T)
  eye = jnp.eye(gram.shape[0], dtype=gram.dtype)
  q = None
  for i, (a, b, c) in enumerate(POLAR_EXPRESS):
    p = a * eye + b * gram + c * gram @ gram
    q = p if q is None else q @ p
    if i + 1 < len(POLAR_EXPRESS):
      gram = p @ gram @ p
  return mm(x, q) if tall else mm(q, x)
