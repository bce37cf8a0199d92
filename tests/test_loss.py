"""model/loss.py: the chunked soft-capped cross-entropy and its hand-written gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax.model import loss as losses


def _reference(h, w, y, vocab):
  z = 15.0 * jnp.tanh((h @ w)[:, :vocab] / 15.0)
  nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, jnp.maximum(y, 0)[:, None], 1)[:, 0]
  return jnp.where(y >= 0, nll, 0.0)


def _inputs(scale=2.0):
  k = jax.random.split(jax.random.key(0), 3)
  N, D, V, Vp = 32, 16, 50, 64
  h = jax.random.normal(k[0], (N, D))
  w = scale * jax.random.normal(k[1], (D, Vp))  # large logits: the soft-cap matters
  y = jax.random.randint(k[2], (N,), 0, V).at[3].set(-1)
  return h, w, y, V


@pytest.mark.parametrize("chunk", [8, 32, 5])
def test_per_row_values_match_reference(chunk):
  h, w, y, V = _inputs()
  nll = losses.softcap_nll(h, w, y, V, chunk)
  np.testing.assert_allclose(nll, _reference(h, w, y, V), rtol=1e-5, atol=1e-5)
  assert float(nll[3]) == 0.0


@pytest.mark.parametrize("chunk, scale", [(8, 2.0), (32, 2.0), (5, 2.0), (8, 40.0)])
def test_sum_value_and_gradients_match_autodiff(chunk, scale):
  # scale 40: logits far past the soft-cap, where exp(z - 15) without a max pass
  # must still be exact (|z| <= 15 by construction).
  h, w, y, V = _inputs(scale)
  g = 0.37  # the cotangent reaches both gradients as one scalar
  f = lambda h, w: g * losses.softcap_nll_sum(h, w, y, V, chunk)
  r = lambda h, w: g * jnp.sum(_reference(h, w, y, V))
  np.testing.assert_allclose(f(h, w), r(h, w), rtol=1e-5)
  got, want = jax.grad(f, argnums=(0, 1))(h, w), jax.grad(r, argnums=(0, 1))(h, w)
  with jax.enable_x64(True):  # the exact answer: autodiff of the reference in float64
    exact = jax.grad(r, argnums=(0, 1))(*(jnp.asarray(np.asarray(x, np.float64)) for x in (h, w)))
  for a, b, t in zip(got, want, exact):
    # fp32 rounding is relative to the gradient's scale (|dh| reaches 25 at scale 40):
    # the kernel is as close to the exact answer as fp32 autodiff is, 1e-6 of that scale
    t = np.asarray(t)
    bound = 1e-6 * np.abs(t).max()
    np.testing.assert_allclose(np.asarray(b, np.float64), t, rtol=0, atol=bound)
    np.testing.assert_allclose(np.asarray(a, np.float64), t, rtol=0, atol=bound)
  # the masked row contributes nothing; the padded vocabulary columns get no gradient
  np.testing.assert_array_equal(np.asarray(got[0][3]), 0.0)
  np.testing.assert_array_equal(np.asarray(got[1][:, V:]), 0.0)


def test_sum_gradient_under_jit_and_in_bfloat16():
  h, w, y, V = _inputs()
  r = jax.grad(lambda h, w: jnp.sum(_reference(h, w, y, V)), argnums=(0, 1))(h, w)
  f = jax.jit(jax.grad(lambda h, w: losses.softcap_nll_sum(h, w, y, V, 8), argnums=(0, 1)))
  dh, dw = f(h.astype(jnp.bfloat16), w)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(dh, np.float32), r[0], rtol=0.05, atol=0.05)
  np.testing.assert_allclose(np.asarray(dw), r[1], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("chunk, seqs", [(8, 4), (16, 4), (12, 2), (32, 32)])
def test_chunks_across_sequences_match_reference(chunk, seqs):
  """Chunks that take the same positions of every sequence (the scan never runs along
  the batch, which a mesh splits) give the same per-row values, sum and gradients."""
  h, w, y, V = _inputs()
  nll = losses.softcap_nll(h, w, y, V, chunk, seqs)
  np.testing.assert_allclose(nll, _reference(h, w, y, V), rtol=1e-5, atol=1e-5)
  f = lambda h, w: losses.softcap_nll_sum(h, w, y, V, chunk, seqs)
  r = lambda h, w: jnp.sum(_reference(h, w, y, V))
  got, want = jax.grad(f, argnums=(0, 1))(h, w), jax.grad(r, argnums=(0, 1))(h, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
