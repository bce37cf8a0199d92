"""The optimizer against a plain numpy transcription of SPEC section 4."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bov_jax.kernels import polar
from bov_jax.optim import optimizer as optim
from bov_jax.run import spec as spec_lib
from bov_jax.settings import config as config_lib

PE = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
      (4.042929935166739, -2.808917465908714, 0.5000178451051316),
      (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
      (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
      (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def np_lr_mult(it, n):
  w = round(0.65 * n)
  if it < 40:
    return (it + 1) / 40
  if it <= n - w:
    return 1.0
  p = (n - it) / w
  return p + (1 - p) * 0.05


def np_momentum(it, n):
  """The reference's order: the warmup branch first, then the warmdown."""
  w = round(0.65 * n)
  if it < 400:
    return 0.85 + 0.12 * it / 400
  if it >= n - w:
    return 0.97 + (0.90 - 0.97) * (it - (n - w)) / w
  return 0.97


class NumpyMuon:
  """SPEC section 4 on a reference-layout matrix W [fan_out, fan_in] (float64)."""

  def __init__(self, shape):
    self.buf = np.zeros(shape)
    out, inp = shape
    self.red = -1 if out >= inp else -2  # over the smaller dim; square: per output
    self.buf2 = np.zeros((out, 1) if self.red == -1 else (1, inp))

  def step(self, p, g, lr, m, wd):
    self.buf = m * self.buf + (1 - m) * g
    u = (1 - m) * g + m * self.buf
    x = u / (np.linalg.norm(u) * 1.01 + 1e-6)
    tall = x.shape[0] > x.shape[1]
    if tall:
      x = x.T
    for a, b, c in PE:
      A = x @ x.T
      x = a * x + (b * A + c * A @ A) @ x
    if tall:
      x = x.T
    v = np.mean(x * x, axis=self.red, keepdims=True)
    self.buf2 = 0.9 * self.buf2 + 0.1 * v
    y = x / np.sqrt(np.maximum(self.buf2, 1e-10))
    y = y * np.linalg.norm(x) / np.linalg.norm(y)
    out, inp = p.shape
    lr_eff = lr * math.sqrt(max(1, out / inp))
    mask = (y * p >= 0)
    return p - (lr_eff * y + lr_eff * wd * p * mask)


class NumpyAdamW:
  def __init__(self, shape, b1, b2, wd):
    self.m, self.v, self.t = np.zeros(shape), np.zeros(shape), 0
    self.b1, self.b2, self.wd = b1, b2, wd

  def step(self, p, g, lr):
    self.t += 1
    p = p * (1 - lr * self.wd)
    self.m = self.b1 * self.m + (1 - self.b1) * g
    self.v = self.b2 * self.v + (1 - self.b2) * g * g
    mh, vh = self.m / (1 - self.b1 ** self.t), self.v / (1 - self.b2 ** self.t)
    return p - lr * mh / (np.sqrt(vh) + 1e-10)


def test_schedules_match_spec():
  for n in (50, 1000, 3766):
    for it in sorted({0, 1, 39, 40, 41, 300, 399, 400, n - round(0.65 * n), n // 2, n - 1}):
      if it >= n:
        continue
      assert float(optim.lr_multiplier(it, n)) == pytest.approx(np_lr_mult(it, n), abs=1e-6)
      assert float(optim.muon_momentum(it, n)) == pytest.approx(np_momentum(it, n), abs=1e-6)
      assert float(optim.muon_weight_decay(it, n, 0.28)) == pytest.approx(
          0.28 * 0.5 * (1 + math.cos(math.pi * it / n)), abs=1e-6)
  assert float(optim.lr_multiplier(999, 1000)) == pytest.approx(1 / 650 + (1 - 1 / 650) * 0.05)


@pytest.mark.parametrize("n, step, want", [
    (120, 0, 0.85), (120, 43, 0.8629), (120, 200, 0.91), (120, 399, 0.9697),
    (3766, 0, 0.85), (3766, 43, 0.8629), (3766, 200, 0.91), (3766, 399, 0.9697),
    (3766, 1318, 0.97), (3766, 3765, 0.90003)])
def test_muon_momentum_pinned(n, step, want):
  """The warmup (it < 400) wins where it overlaps the warmdown (N - 0.65 N = 42 for a
  120-step run): step 43 is 0.8629, not the warmdown's 0.969."""
  assert float(optim.muon_momentum(step, n)) == pytest.approx(want, abs=5e-5)


@pytest.mark.parametrize("shape", [(8, 8), (6, 10), (12, 5)])
def test_muon_matches_numpy_over_several_steps(shape):
  """Our weights are [fan_in, fan_out]: the numpy reference works on the transpose."""
  n_steps, n_iter, base_lr, wd = 4, 100, 0.02, 0.28
  rng = np.random.default_rng(0)
  p0 = rng.standard_normal(shape).astype(np.float32)
  grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(n_steps)]
  tx = optim.muon(lambda it: base_lr * optim.lr_multiplier(it, n_iter),
                  lambda it: optim.muon_momentum(it, n_iter),
                  lambda it: optim.muon_weight_decay(it, n_iter, wd))
  p, state = jnp.asarray(p0), tx.init(jnp.asarray(p0))
  ref, pr = NumpyMuon(shape[::-1]), p0.T.astype(np.float64)
  for it, g in enumerate(grads):
    upd, state = jax.jit(tx.update)(jnp.asarray(g), state, p)
    p = optax.apply_updates(p, upd)
    pr = ref.step(pr, g.T.astype(np.float64), base_lr * np_lr_mult(it, n_iter),
                  np_momentum(it, n_iter), wd * 0.5 * (1 + math.cos(math.pi * it / n_iter)))
    np.testing.assert_allclose(np.asarray(p), pr.T, rtol=2e-4, atol=2e-6)


def test_polar_express_orthogonalises():
  x = jax.random.normal(jax.random.key(0), (32, 64))
  o = np.asarray(polar.polar_express(x))
  s = np.linalg.svd(o, compute_uv=False)
  assert 0.6 < s.min() and s.max() < 1.3  # Polar Express lands singular values near 1


def _np_polar_express(u):
  x = np.asarray(u, np.float64)
  x = x / (np.linalg.norm(x) * 1.01 + 1e-6)
  for a, b, c in PE:
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x


@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (96, 64)])
@pytest.mark.parametrize("spectrum", ["gaussian", "decaying"])
def test_gram_space_polar_express_matches_float64(shape, spectrum):
  """Aspect >= 1.5 in float32 runs in the Gram space (fewer FLOPs): the same
  polynomial as the direct iteration, checked against it in float64, including
  a matrix with singular values from 1 down to 1e-6 (where squaring them in the
  Gram matrix could have lost the small ones)."""
  rng = np.random.default_rng(0)
  m, n = shape
  if spectrum == "gaussian":
    u = rng.standard_normal(shape)
  else:
    a, _ = np.linalg.qr(rng.standard_normal((m, min(m, n))))
    b, _ = np.linalg.qr(rng.standard_normal((n, min(m, n))))
    u = (a * np.logspace(0, -6, min(m, n))) @ b.T
  want = _np_polar_express(u)
  got = np.asarray(polar.polar_express(jnp.asarray(u, jnp.float32)))
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < (2e-5 if spectrum == "gaussian" else 3e-3), err
  bf16 = np.asarray(polar.polar_express(jnp.asarray(u, jnp.float32), jnp.bfloat16, gram=False))
  bf16_err = np.abs(bf16 - want).max() / np.abs(want).max()
  assert err < 0.1 * bf16_err  # far inside the reference's rounding
  # X in bf16 (the default): only X's rounding, no instability from the Gram space
  mixed = np.asarray(polar.polar_express(jnp.asarray(u, jnp.float32), jnp.bfloat16))
  assert np.abs(mixed - want).max() / np.abs(want).max() < 2 * bf16_err


def test_gram_space_form_is_chosen_by_shape_and_setting():
  def dots(shape, dtype=jnp.float32, gram=True):
    jaxpr = jax.make_jaxpr(lambda u: polar.polar_express(u, dtype, gram))(jnp.ones(shape))
    return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]

  n_dots = lambda *a: len(dots(*a))
  assert n_dots((256, 64)) == n_dots((64, 256)) == n_dots((96, 64)) == 19  # 17 small + 2
  assert n_dots((256, 64), jnp.bfloat16) == 19
  # bf16 X: its two products with X take bf16 operands, the Gram space stays float32
  operands = [{v.aval.dtype for v in e.invars} for e in dots((256, 64), jnp.bfloat16)]
  assert sum(d == {jnp.dtype("bfloat16")} for d in operands) == 2
  assert sum(d == {jnp.dtype("float32")} for d in operands) == 17
  assert n_dots((64, 64)) == n_dots((80, 64)) == 15  # direct: 3 a step
  assert n_dots((256, 64), jnp.float32, False) == 15  # polar_gram=false: the reference's iteration
  # bf16 operands, float32 products
  for e in dots((64, 64), jnp.bfloat16):
    assert {v.aval.dtype for v in e.invars} == {jnp.dtype("bfloat16")}
    assert e.outvars[0].aval.dtype == jnp.dtype("float32")


@pytest.mark.parametrize("shape", [(48, 48), (32, 96), (96, 32)])
def test_bf16_polar_express_tracks_fp32(shape):
  """optim.polar_dtype=bfloat16 (the reference's choice, the default on GPU/TPU):
  the same near-orthogonal direction as fp32, handed back as float32. Polar
  Express does not converge to the exact polar factor, so bf16 rounding moves
  the small singular values (~10% relative difference); the direction stays."""
  u = jax.random.normal(jax.random.key(3), shape)
  full = np.asarray(polar.polar_express(u, gram=False))
  half = polar.polar_express(u, jnp.bfloat16, gram=False)
  assert half.dtype == jnp.float32
  half = np.asarray(half)
  cos = np.sum(half * full) / (np.linalg.norm(half) * np.linalg.norm(full))
  assert 0.99 < cos < 0.99999, cos  # rounding shows (it ran in bf16), the direction agrees
  s = np.linalg.svd(half, compute_uv=False)
  assert 0.3 < s.min() and s.max() < 1.3


def test_polar_dtype_and_gram_settings():
  c = config_lib.base_config()
  o = spec_lib.resolve(c).optim
  assert o.polar_dtype == "bfloat16"  # the reference's
  assert o.polar_gram == (jax.default_backend() == "cpu")
  assert spec_lib.resolve(c, "tpu").optim.polar_gram is False
  assert spec_lib.resolve(c, "cpu").optim.muon_batched is False
  assert spec_lib.resolve(c, "gpu").optim.muon_batched is True
  c.optim.polar_dtype, c.optim.polar_gram = "float32", "false"
  o = spec_lib.resolve(c).optim
  assert o.polar_dtype == "float32" and o.polar_gram is False
  c.optim.polar_dtype = "fp8"
  with pytest.raises(config_lib.ConfigError, match=r"optim\.polar_dtype='fp8'"):
    spec_lib.resolve(c)
  c.optim.polar_dtype, c.optim.polar_gram = "auto", "yes"
  with pytest.raises(config_lib.ConfigError, match=r"optim\.polar_gram='yes'"):
    spec_lib.resolve(c)


def _tiny_params():
  rng = np.random.default_rng(1)
  r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return {"wte": r(16, 8), "lm_head": r(8, 16), "smear_w": r(24), "smear_lambda": r(),
          "blocks": {0: {"attn": {"wq": r(8, 8), "coeffs": {"alpha": r(), "beta": r()}},
                         "mlp": {"w_fc": r(8, 32)}},
                     1: {"attn": {"coeffs": {"gamma": r()}, "gate": r(12, 2)}}},
          "tables": {"layer_1": r(16, 8)}}


def test_groups_by_path():
  lab = optim.labels(_tiny_params())
  assert lab["wte"] == "embed" and lab["lm_head"] == "unembed"
  assert lab["smear_w"] == lab["smear_lambda"] == "smear"
  assert lab["blocks"][0]["attn"]["wq"] == lab["blocks"][0]["mlp"]["w_fc"] == "muon"
  assert lab["blocks"][1]["attn"]["gate"] == "muon"
  assert lab["blocks"][0]["attn"]["coeffs"]["alpha"] == "alpha"
  assert lab["blocks"][0]["attn"]["coeffs"]["beta"] == "beta_gamma"
  assert lab["blocks"][1]["attn"]["coeffs"]["gamma"] == "beta_gamma"
  assert lab["tables"]["layer_1"] == "table"


def test_paper_hyperparameters():
  for depth, batch, matrix, scalar, wd in ((12, 2 ** 19, 0.02, 0.5, 0.28),
                                           (24, 2 ** 20, 0.0283, 0.707, 0.0597)):
    c = config_lib.depth_config(depth, "gpt_base_v_from_value_emb_learn")
    c.train.batch_tokens = batch
    hp = spec_lib.resolve(c).optim.hyperparams
    assert hp["muon"] == pytest.approx(matrix, abs=5e-5)
    assert hp["beta_gamma"] == pytest.approx(scalar, abs=5e-4)
    assert hp["muon_weight_decay"] == pytest.approx(wd, abs=5e-5)
    assert hp["table"] == pytest.approx(0.15, abs=1e-9)
    assert hp["smear"] == 0.2


def test_full_optimizer_matches_numpy_per_group():
  """Several steps of the partitioned optimizer: every group against its numpy transcription
  (Polar Express in float32 here; its bfloat16 rounding is tested above)."""
  c = config_lib.depth_config(12)
  c.optim.polar_dtype = c.optim.muon_update_dtype = "float32"
  n = 50
  hp = {"unembed": 0.008, "embed": 0.3, "smear": 0.2, "alpha": 0.005, "beta_gamma": 0.5,
        "table": 0.15, "muon": 0.02, "muon_weight_decay": 0.28}
  tx = optim.make(spec_lib.resolve(c).optim, n, hp)
  params = _tiny_params()
  state = tx.init(params)
  flat, tree = jax.tree.flatten(params)
  labels = jax.tree.leaves(optim.labels(params))
  refs = []
  for p, lab in zip(flat, labels):
    if lab == "muon":
      refs.append(NumpyMuon(p.shape[::-1]))
    else:
      (b1, b2), wd = optim.ADAM_GROUPS[lab]
      refs.append(NumpyAdamW(p.shape, b1, b2, wd))
  ref_p = [np.asarray(p, np.float64) for p in flat]
  rng = np.random.default_rng(7)
  update = jax.jit(tx.update)
  for it in range(3):
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in flat]
    upd, state = update(jax.tree.unflatten(tree, [jnp.asarray(g) for g in grads]), state, params)
    params = optax.apply_updates(params, upd)
    mult = np_lr_mult(it, n)
    for k, (lab, ref) in enumerate(zip(labels, refs)):
      if lab == "muon":
        ref_p[k] = ref.step(ref_p[k].T, grads[k].T.astype(np.float64), 0.02 * mult,
                            np_momentum(it, n),
                            0.28 * 0.5 * (1 + math.cos(math.pi * it / n))).T
      else:
        ref_p[k] = ref.step(ref_p[k], grads[k].astype(np.float64), hp[lab] * mult)
    for got, want, lab in zip(jax.tree.leaves(params), ref_p, labels):
      np.testing.assert_allclose(np.asarray(got), want, rtol=3e-4, atol=3e-6, err_msg=lab)


@pytest.mark.slow
def test_batched_polar_express_equals_one_at_a_time():
  rng = np.random.default_rng(5)
  ps = {k: jnp.asarray(rng.standard_normal(s), jnp.float32)
        for k, s in (("a", (8, 8)), ("b", (8, 8)), ("c", (8, 16)), ("d", (16, 8)))}
  gs = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in ps.items()}
  out = []
  for batched in (True, False):
    tx = optim.muon(lambda i: 0.02, lambda i: 0.9, lambda i: 0.1, batched=batched)
    state = tx.init(ps)
    for _ in range(2):
      u, state = tx.update(gs, state, ps)
    out.append(u)
  for k in ps:
    np.testing.assert_allclose(np.asarray(out[0][k]), np.asarray(out[1][k]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decoupled_decay_cannot_move_a_bfloat16_table(dtype):
  """The reference stores tables in bfloat16, Adam moments too: a row whose Adam step has
  faded is never decayed (lr * wd = 0.0015 is under half a bfloat16 ulp), where float32
  decays it step by step."""
  c = config_lib.depth_config(12, "gpt_base_v_from_value_emb_learn")
  c.model.embedding_dtype = dtype
  s = spec_lib.resolve(c)
  hp = s.optim.hyperparams
  assert hp["table"] * optim.ADAM_GROUPS["table"][1] == pytest.approx(0.0015)
  tx = optim.make(s.optim, 1000, hp)
  row = jnp.asarray([[0.5, -1.25, 3.0, 0.1]], jnp.dtype(dtype))
  p = {"tables": {"layer_8": row}}
  state = tx.init(p)
  moments = [x for x in jax.tree.leaves(state) if x.shape == row.shape]
  assert len(moments) == 2 and all(m.dtype == row.dtype for m in moments)
  for _ in range(100):  # zero gradients: only the decay acts
    u, state = tx.update(jax.tree.map(jnp.zeros_like, p), state, p)
    p = optax.apply_updates(p, u)
  got, start = (np.asarray(x, np.float32) for x in (p["tables"]["layer_8"], row))
  if dtype == "bfloat16":
    np.testing.assert_array_equal(got, start)
  else:
    decay = np.prod([1 - 0.0015 * np_lr_mult(it, 1000) for it in range(100)])
    np.testing.assert_allclose(got, start * decay, rtol=1e-5)


def test_muon_update_in_bfloat16_rounds_as_the_reference():
  """update_dtype=bfloat16: X, lr, wd and p cast to bfloat16, lr*X + lr*wd*p*mask formed in
  bfloat16, then applied to the float32 parameter."""
  rng = np.random.default_rng(3)
  p = {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}
  g = {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}
  lr, wd = 0.0213, 0.28
  out = {}
  for dt in (jnp.float32, jnp.bfloat16):
    tx = optim.muon(lambda i: lr, lambda i: 0.9, lambda i: wd, update_dtype=dt)
    out[dt] = np.asarray(tx.update(g, tx.init(p), p)[0]["w"])
  x, _, _ = optim.muon_direction(g["w"], jnp.zeros((8, 8)), jnp.zeros((1, 8)), 0.9)
  b = lambda v: jnp.asarray(v, jnp.bfloat16)
  mask = (x * p["w"] >= 0).astype(jnp.bfloat16)
  want = -(b(lr) * b(x) + b(lr) * b(wd) * b(p["w"]) * mask)
  np.testing.assert_array_equal(out[jnp.bfloat16], np.asarray(want.astype(jnp.float32)))
  assert out[jnp.bfloat16].dtype == np.float32
  assert not np.array_equal(out[jnp.bfloat16], out[jnp.float32])  # the rounding shows
  np.testing.assert_allclose(out[jnp.bfloat16], out[jnp.float32], rtol=2e-2, atol=1e-4)
