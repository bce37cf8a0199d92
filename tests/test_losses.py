"""The chunked soft-capped cross-entropy and its hand-written backward against autodiff."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax import losses


def _reference(h, w, y, vocab):
  z = 15.0 * jnp.tanh((h @ w)[:, :vocab] / 15.0)
  nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, jnp.maximum(y, 0)[:, None], 1)[:, 0]
  return jnp.where(y >= 0, nll, 0.0)


@pytest.mark.parametrize("chunk, keep", [(8, False), (8, True), (32, False), (5, True)])
def test_value_and_gradients_match_autodiff(chunk, keep):
  k = jax.random.split(jax.random.key(0), 4)
  N, D, V, Vp = 32, 16, 50, 64
  h = jax.random.normal(k[0], (N, D))
  w = 2.0 * jax.random.normal(k[1], (D, Vp))  # large logits: the soft-cap matters
  y = jax.random.randint(k[2], (N,), 0, V).at[3].set(-1)
  g = jax.random.normal(k[3], (N,))
  f = lambda h, w: jnp.sum(g * losses.softcap_nll(h, w, y, V, chunk, keep))
  r = lambda h, w: jnp.sum(g * _reference(h, w, y, V))
  np.testing.assert_allclose(losses.softcap_nll(h, w, y, V, chunk, keep), _reference(h, w, y, V),
                             rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.grad(f, argnums=(0, 1))(h, w), jax.grad(r, argnums=(0, 1))(h, w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  assert float(losses.softcap_nll(h, w, y, V, chunk, keep)[3]) == 0.0
