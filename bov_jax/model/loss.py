"""Cross-entropy of the soft-capped LM head, chunked over rows (every backend).

    z = 15 tanh((h @ W)[:, :V] / 15)    (fp32)      nll = logsumexp(z) - z[y]

Autodiff of this spends most of its time materialising fp32 [N, V] logits
twice and scattering the target gradient (take_along_axis' transpose is a
scatter, slow on CPU and memory-bound everywhere). Rows are processed in
chunks under a `lax.scan`, so no full-batch logits ever exist.

Training differentiates the summed loss, whose gradient is the same for every
row up to one scalar. `softcap_nll_sum` therefore forms each chunk's gradient
while that chunk's logits are still in cache (dz = (softmax(z) - onehot(y)) *
(1 - tanh^2), with an iota comparison, then dh = dz W^T and dW += h^T dz) and
its backward only scales them: one pass over the logits instead of a forward
pass plus a backward that re-reads or recomputes them (the fused linear
cross-entropy of Liger-Kernel).

Because |z| <= 15, exp(z - 15) lies in [e^-30, 1]: the log-sum-exp needs no
max pass, and softmax reuses the exponentials of the sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bov_jax.parallel import sharding

SOFTCAP = 15.0  # logits = 15 tanh(z / 15), as the reference's gpt.py


def _split(n, chunk):
  chunk = min(chunk, n)
  while n % chunk:
    chunk -= 1
  return chunk


def _head(w, vocab, dtype):
  """The LM head's real-vocabulary columns [D, V] in the compute dtype, once per call."""
  return w[:, :vocab].astype(dtype)


def _chunk_nll(hc, yc, wv):
  """(nll [c] (0 where y == -1), tanh [c, V], exp(z - 15) [c, V], their row sums [c])."""
  t = jnp.tanh((hc @ wv).astype(jnp.float32) / SOFTCAP)
  e = jnp.exp(SOFTCAP * t - SOFTCAP)
  s = jnp.sum(e, axis=-1)
  # A gather of c values (never differentiated: the gradients are written by
  # hand) instead of a select over the whole [c, V] chunk, but inside a shard_map,
  # where XLA cannot split that gather (sharding.in_shard_map).
  if sharding.in_shard_map():
    ty = jnp.sum(jnp.where(jnp.arange(t.shape[1]) == yc[:, None], t, 0.0), axis=1)
  else:
    ty = jnp.take_along_axis(t, jnp.maximum(yc, 0)[:, None], axis=1)[:, 0]
  nll = jnp.log(s) + SOFTCAP - SOFTCAP * ty
  return jnp.where(yc >= 0, nll, 0.0), t, e, s


def _chunks(x, chunk, seqs):
  """x [N, ...] as [n, c, ...], chunks of about `chunk` rows. x holds `seqs` sequences
  back to back, and a chunk takes the same positions of every one: the scan over chunks
  then runs along positions, never along the sequences, which a batch sharding splits
  (a scan along them would gather the whole batch onto every device)."""
  T = x.shape[0] // seqs
  p = _split(T, max(1, chunk // seqs))
  x = x.reshape(seqs, T // p, p, *x.shape[1:]).swapaxes(0, 1)
  return x.reshape(T // p, seqs * p, *x.shape[3:])


def _unchunk(x, seqs):
  """The inverse of `_chunks`: [n, c, ...] back to [N, ...] in sequence order."""
  n, c = x.shape[:2]
  x = x.reshape(n, seqs, c // seqs, *x.shape[2:]).swapaxes(0, 1)
  return x.reshape(n * c, *x.shape[3:])


def softcap_nll(h_ND, w_DV, y_N, vocab: int, chunk: int = 1024, seqs: int = 1):
  """Per-row NLL [N] (0 where y == -1) of the soft-capped logits; h [N, D] (`seqs`
  sequences back to back), w [D, Vp].

  For evaluation; training uses `softcap_nll_sum`, whose gradient is hand-written.
  """
  wv = _head(w_DV, vocab, h_ND.dtype)

  def body(_, hy):
    return None, _chunk_nll(*hy, wv)[0]

  _, nll = jax.lax.scan(body, None, (_chunks(h_ND, chunk, seqs), _chunks(y_N, chunk, seqs)))
  return _unchunk(nll, seqs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def softcap_nll_sum(h_ND, w_DV, y_N, vocab: int, chunk: int = 1024, seqs: int = 1):
  """Sum over rows of `softcap_nll`, with its gradient formed chunk by chunk in
  the forward pass."""
  return _sum_fwd(h_ND, w_DV, y_N, vocab, chunk, seqs)[0]


def _sum_fwd(h, w, y, vocab, chunk, seqs):
  D = h.shape[1]
  wv = _head(w, vocab, h.dtype)

  def body(dw, hy):
    hc, yc = hy
    nll, t, e, s = _chunk_nll(hc, yc, wv)
    hit = jnp.arange(vocab)[None, :] == yc[:, None]
    dz = (e * (1.0 / s)[:, None] - hit) * (1.0 - t * t)  # through the soft-cap
    dz = jnp.where((yc >= 0)[:, None], dz, 0.0).astype(h.dtype)
    # The product in float32 (bf16 operands), added in place: on GPU the add
    # folds into the matmul's output (cuBLAS's beta = 1) instead of running as
    # a [D, V] pass per chunk, and no chunk's contribution is rounded to bf16 first.
    dw = dw + jnp.matmul(hc.T, dz, preferred_element_type=jnp.float32)
    return dw, (jnp.sum(nll), dz @ wv.T)

  dw, (nll, dh) = jax.lax.scan(body, jnp.zeros((D, vocab), jnp.float32),
                               (_chunks(h, chunk, seqs), _chunks(y, chunk, seqs)))
  dw = jnp.pad(dw, ((0, 0), (0, w.shape[1] - vocab))).astype(w.dtype)
  return jnp.sum(nll), (_unchunk(dh, seqs), dw)


def _sum_bwd(vocab, chunk, seqs, res, g):
  del vocab, chunk, seqs
  dh, dw = res
  return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None


softcap_nll_sum.defvjp(_sum_fwd, _sum_bwd)
