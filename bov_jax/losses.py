"""Cross-entropy of the soft-capped LM head, chunked, with a hand-written backward.

    z = 15 tanh((h @ W)[:, :V] / 15)    (fp32)      nll = logsumexp(z) - z[y]

Autodiff of this spends most of its time materialising fp32 [N, V] logits
twice and scattering the target gradient (take_along_axis' transpose is a
scatter, slow on CPU and memory-bound everywhere). Here rows are processed in
chunks under a `lax.scan`; the backward recomputes each chunk's logits and
forms dz = (softmax(z) - onehot(y)) * (1 - tanh^2) with an iota comparison, so
no full-batch logits ever exist and no scatter runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SOFTCAP = 15.0


def _chunk_logits(h, w, vocab):
  u = (h @ w.astype(h.dtype))[:, :vocab].astype(jnp.float32) / SOFTCAP
  t = jnp.tanh(u)
  return SOFTCAP * t, t


def _split(n, chunk):
  chunk = min(chunk, n)
  while n % chunk:
    chunk -= 1
  return chunk


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def softcap_nll(h_ND, w_DV, y_N, vocab: int, chunk: int = 1024, keep_tanh: bool = False):
  """Per-row NLL (0 where y == -1) of the soft-capped logits; h [N, D], w [D, Vp].

  keep_tanh keeps the fp32 tanh of every chunk for the backward instead of
  recomputing the chunk's logits (N x V x 4 bytes: worth it only when small).
  """
  return _fwd(h_ND, w_DV, y_N, vocab, chunk, keep_tanh)[0]


def _fwd(h, w, y, vocab, chunk, keep_tanh=False):
  N = h.shape[0]
  c = _split(N, chunk)

  def body(_, hy):
    hc, yc = hy
    z, t = _chunk_logits(hc, w, vocab)
    lse = jax.nn.logsumexp(z, axis=-1)
    # A gather of N values (its transpose, a scatter, never runs: the backward
    # is hand-written) instead of a select over the whole [N, V] chunk.
    zy = jnp.take_along_axis(z, jnp.maximum(yc, 0)[:, None], axis=1)[:, 0]
    return None, (jnp.where(yc >= 0, lse - zy, 0.0), lse, t if keep_tanh else None)

  _, (nll, lse, t) = jax.lax.scan(body, None, (h.reshape(N // c, c, -1), y.reshape(N // c, c)))
  return nll.reshape(N), (h, w, y, lse.reshape(N), t)


def _bwd(vocab, chunk, res, g):
  h, w, y, lse, t_kept = res
  N, D = h.shape
  c = _split(N, chunk)
  wv = w.astype(h.dtype)

  def body(dw, args):
    hc, yc, lc, gc, tc = args
    if tc is None:  # recompute this chunk's logits (one more matmul, no stored logits)
      _, tc = _chunk_logits(hc, w, vocab)
    t = tc
    p = jnp.exp(SOFTCAP * t - lc[:, None])
    hit = jnp.arange(vocab)[None, :] == yc[:, None]
    gc = jnp.where(yc >= 0, gc, 0.0)
    dz = (p - hit.astype(p.dtype)) * gc[:, None] * (1.0 - t * t)  # through the soft-cap
    dz = dz.astype(h.dtype)
    dh = dz @ wv[:, :vocab].T
    dw = dw + (hc.T @ dz).astype(jnp.float32)
    return dw, dh

  dw0 = jnp.zeros((D, vocab), jnp.float32)
  dw, dh = jax.lax.scan(body, dw0, (h.reshape(N // c, c, D), y.reshape(N // c, c),
                                    lse.reshape(N // c, c), g.reshape(N // c, c), t_kept))
  dw = jnp.pad(dw, ((0, 0), (0, w.shape[1] - vocab))).astype(w.dtype)
  return dh.reshape(N, D).astype(h.dtype), dw, None


softcap_nll.defvjp(lambda h, w, y, vocab, chunk, keep: _fwd(h, w, y, vocab, chunk, keep),
                   lambda vocab, chunk, keep, res, g: _bwd(vocab, chunk, res, g))
