"""The transformer and its value modes: causality, context-freedom, aligned init, grads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bov_jax.kernels import attention
from bov_jax.kernels.matmul import mm
from bov_jax.model import gpt as model_lib
from bov_jax.settings import values
from tests.helpers import init_model
from tests.helpers import model_spec
from tests.helpers import random_model
from tests.helpers import small_config

ALL_PRESETS = sorted(values.PRESETS)


def _idx(T=40, B=2, seed=0, V=100):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpt_base", "gpt_base_v_from_value_emb_learn",
                                    "gpt_base_add_init_v_learn", "gpt_base_v_from_x0",
                                    "gpt_base_add_init_value_emb_nanogpt"])
def test_causal(preset):
  m = random_model(small_config(preset))
  idx = _idx()
  t = 25
  idx2 = idx.at[:, t].set((idx[:, t] + 7) % 100)
  a, b = m(idx), m(idx2)
  np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(b[:, :t]))
  assert np.abs(np.asarray(a[:, t:] - b[:, t:])).max() > 1e-6


def test_sliding_window_limits_what_a_layer_sees():
  """A window of 8: a token 9+ positions back is invisible. (The model's last layer is
  always full, so the attention function is tested directly.)"""
  q = jax.random.normal(jax.random.key(0), (1, 20, 4, 16))
  k = jax.random.normal(jax.random.key(1), (1, 20, 2, 16))
  v = jax.random.normal(jax.random.key(2), (1, 20, 2, 16))
  pos = jnp.arange(20)[None]
  rows = attention.kv_rows
  out = attention.attend(q, rows(k), rows(v), pos, pos, 8)
  v2 = v.at[:, 5].add(10.0)
  out2 = attention.attend(q, rows(k), rows(v2), pos, pos, 8)
  diff = np.abs(np.asarray(out - out2)).max(axis=(0, 2))
  assert np.all(diff[:5] == 0) and np.all(diff[5:14] > 0) and np.all(diff[14:] == 0)


def test_last_layer_always_full():
  cfg = small_config("gpt_base", window_pattern="S", sequence_len=64, short_window=8)
  assert model_spec(cfg).windows == (8, 8, 8, 8, 8, 64)
  cfg = small_config("gpt_base", short_window=0, sequence_len=2048)
  assert model_spec(cfg).windows == (512, 512, 512, 2048, 512, 2048)
  assert model_spec(small_config(short_window=0, sequence_len=512)).windows[0] == 128 * 1


def _layer_values(m, idx):
  """Each layer's values (after its mode's combination), from the model's own blocks run
  in order as GPT.hidden runs them."""
  x, _ = m.embed(idx)
  x0n = model_lib.rmsnorm(x)
  cs = model_lib.rope(np.arange(idx.shape[1])[None], m.spec.head_dim)
  v1, out = None, []
  for i, block in enumerate(m.blocks):
    x, v, _ = block(x, cs, m.v_tilde(block.attn, x0n, v1, idx, m.table(i)))
    v1 = v if i == 0 else v1
    out.append(np.asarray(v))
  return out


def test_table_replace_values_do_not_depend_on_context():
  cfg = small_config("gpt_base_v_from_value_emb_learn")  # targets 4, 5
  m = random_model(cfg)
  idx = _idx(T=30)
  other = idx.at[:, :20].set(_idx(T=20, seed=5))  # a different prefix, same tokens 20..29
  a, b = _layer_values(m, idx), _layer_values(m, other)
  for layer in (4, 5):
    np.testing.assert_array_equal(a[layer][:, 20:], b[layer][:, 20:])
  assert np.abs(a[3][:, 20:] - b[3][:, 20:]).max() > 1e-5  # a non-target layer does depend


def test_v1_targets_reuse_layer0_values():
  m = random_model(small_config("gpt_base_v_from_v1"))
  vals = _layer_values(m, _idx())
  for layer in (4, 5):
    np.testing.assert_array_equal(vals[layer], vals[0])


def test_bov_at_init_equals_x0_replace_at_init():
  key = jax.random.key(3)
  bov = init_model(small_config("gpt_base_v_from_value_emb_learn"), key)
  x0 = init_model(small_config("gpt_base_v_from_x0_learn"), key)
  # W_o is zero at init, so make both models' outputs sensitive to V the same way
  for m in (bov, x0):
    for i, b in enumerate(m.blocks):
      b.attn.wo.set_value(0.1 * jax.random.normal(jax.random.key(100 + i), b.attn.wo.shape))
  idx = _idx()
  np.testing.assert_allclose(np.asarray(bov(idx)), np.asarray(x0(idx)), atol=2e-5)
  vb, vx = _layer_values(bov, idx), _layer_values(x0, idx)
  assert np.abs(vb[5]).max() > 0.1
  np.testing.assert_allclose(vb[5], vx[5], atol=2e-5)


def test_shared_table_is_initialised_from_first_target():
  key = jax.random.key(0)
  m = init_model(small_config("gpt_base_v_from_value_emb_learn_shared"), key)
  ref = init_model(small_config("gpt_base_v_from_x0"), key)
  want = model_lib.rmsnorm(ref.wte[...]) @ ref.blocks[4].attn.wv[...]
  np.testing.assert_allclose(np.asarray(m.tables["shared"][...]), np.asarray(want), atol=1e-6)


def test_initialisation_statistics():
  cfg = small_config("gpt_base_add_init_value_emb_nanogpt", n_embd=128, n_head=4)
  m = init_model(cfg, jax.random.key(0))
  s = np.sqrt(3) / np.sqrt(128)
  assert abs(float(jnp.std(m.wte[...])) - 0.8) < 0.03
  assert abs(float(jnp.std(m.lm_head[...])) - 0.001) < 1e-4
  a = m.blocks[0].attn
  assert float(jnp.max(jnp.abs(a.wq[...]))) <= s and float(jnp.max(a.wq[...])) > 0.9 * s
  assert float(jnp.max(jnp.abs(m.blocks[0].mlp.w_fc[...]))) <= 0.4 * s
  assert float(jnp.abs(a.wo[...]).max()) == 0 and float(jnp.abs(m.blocks[0].mlp.w_proj[...]).max()) == 0
  assert float(m.smear_lambda[...]) == 0
  assert 0 <= float(m.smear_w[...].min()) and float(m.smear_w[...].max()) <= 0.02
  g = m.blocks[5].attn.gate[...]
  assert g.shape == (12, 2) and 0 <= float(g.min()) and float(g.max()) <= 0.02
  t = m.tables["layer_5"][...]
  assert float(jnp.max(jnp.abs(t))) <= s and float(jnp.std(t)) > 0.5 * s / np.sqrt(3)
  learn = init_model(small_config("gpt_base_add_init_v_learn"), jax.random.key(0))
  assert float(learn.blocks[5].attn.coeffs["alpha"][...]) == 1.0
  assert float(learn.blocks[5].attn.coeffs["beta"][...]) == 0.0


def _param_names(preset, **kw):
  st = nnx.state(model_lib.abstract(model_spec(small_config(preset, **kw))))
  return {"/".join(str(p) for p in path) for path, _ in nnx.to_flat_state(st)}


def test_parameter_sets_per_preset():
  base = _param_names("gpt_base")
  assert all(f"blocks/{i}/attn/wv" in base for i in range(6))
  assert not any(n.startswith("tables") or "coeffs" in n or "gate" in n for n in base)
  bov = _param_names("gpt_base_v_from_value_emb_learn")
  assert {n for n in bov if n.startswith("tables")} == {"tables/layer_4", "tables/layer_5"}
  assert "blocks/4/attn/wv" not in bov and "blocks/5/attn/wv" not in bov
  assert "blocks/3/attn/wv" in bov and "blocks/5/attn/coeffs/gamma" in bov
  assert "blocks/3/attn/coeffs/gamma" not in bov
  shared = _param_names("gpt_base_v_from_value_emb_learn_shared")
  assert {n for n in shared if n.startswith("tables")} == {"tables/shared"}
  fixed = _param_names("gpt_base_v_from_value_emb")
  assert not any("coeffs" in n for n in fixed)
  v1 = _param_names("gpt_base_v_from_v1_every_layer")
  assert "blocks/0/attn/wv" in v1 and not any(f"blocks/{i}/attn/wv" in v1 for i in range(1, 6))
  x0 = _param_names("gpt_base_v_from_x0_learn")
  assert all(f"blocks/{i}/attn/wv" in x0 for i in range(6))
  add = _param_names("gpt_base_add_init_v_learn")
  assert {"blocks/5/attn/coeffs/alpha", "blocks/5/attn/coeffs/beta"} <= add
  gated = _param_names("gpt_base_add_init_value_emb_nanogpt_every2")
  assert {n for n in gated if n.endswith("gate")} == {f"blocks/{i}/attn/gate" for i in (1, 3, 5)}
  assert all(f"blocks/{i}/attn/wv" in gated for i in range(6))
  scale = _param_names("gpt_base_v_scale_learn")
  assert "blocks/5/attn/coeffs/gamma" in scale and "blocks/5/attn/wv" in scale


@pytest.mark.slow
@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_every_mode_runs_forward_and_backward(preset):
  # W_o = 0 at init would zero every value gradient, hence random weights;
  # three layers keep compile time down and still give every mode a target.
  m = random_model(small_config(preset, n_layer=3))
  graphdef, state = nnx.split(m)
  idx = _idx(T=24)

  @jax.jit
  def loss_and_grad(state):
    def f(state):
      return nnx.merge(graphdef, state).loss(idx[:, :-1], idx[:, 1:])
    return jax.value_and_grad(f)(state)

  loss, grads = loss_and_grad(state)
  assert np.isfinite(float(loss)) and abs(float(loss) - np.log(100)) < 1.0
  for path, g in nnx.to_flat_state(grads):  # every parameter, tables included, learns
    g = np.asarray(g[...])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, path


def test_loss_ignores_minus_one_targets():
  m = random_model(small_config("gpt_base"))
  idx = _idx(T=16)
  tgt = idx.at[:, 8:].set(-1)
  nll = m.token_losses(idx, tgt)
  assert float(jnp.abs(nll[:, 8:]).max()) == 0
  np.testing.assert_allclose(float(m.loss(idx, tgt)), float(nll[:, :8].mean()), rtol=1e-6)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights():
  """Matrices stay float32 under bfloat16 compute; the token embedding and the value
  tables are stored as the reference stores them (bfloat16: model.embedding_dtype=auto),
  or float32 when asked."""
  cfg = small_config("gpt_base_v_from_value_emb_learn", dtype="bfloat16")
  m = init_model(cfg, jax.random.key(0))
  assert m.wte[...].dtype == jnp.bfloat16 and m.tables["layer_5"][...].dtype == jnp.bfloat16
  assert m.blocks[0].attn.wq[...].dtype == jnp.float32 and m.lm_head[...].dtype == jnp.float32
  cfg = small_config("gpt_base_v_from_value_emb_learn", dtype="bfloat16",
                     embedding_dtype="float32")
  m = init_model(cfg, jax.random.key(0))
  assert m.wte[...].dtype == jnp.float32 and m.tables["layer_5"][...].dtype == jnp.float32
  out = m(_idx())
  assert out.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(out)))
  ref = init_model(small_config("gpt_base_v_from_value_emb_learn"), jax.random.key(0))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref(_idx())), atol=5e-2)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpt_base", "gpt_base_v_from_value_emb_learn",
                                    "gpt_base_v_from_v1_learn"])
def test_remat_policies_recompute_and_keep_gradients(preset):
  """model.remat changes what the backward recomputes (more matmuls in the
  compiled program: `dots` keeps every matmul output, `dots_no_batch` recomputes
  the attention scores, `full` the whole layer), never the gradients. Three layers:
  each preset still has a target layer, and the v1 source crosses layers."""
  idx = _idx(T=33, B=2)
  grads, n_dots = {}, {}
  for policy in ("none", "dots", "dots_no_batch", "full"):
    m = random_model(small_config(preset, remat=policy, n_layer=3))
    graphdef, state = nnx.split(m)
    params = nnx.to_pure_dict(state)
    f = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p).loss(idx[:, :-1], idx[:, 1:])))
    compiled = f.lower(params).compile()  # compiled once: run, then read its HLO
    grads[policy] = compiled(params)
    n_dots[policy] = compiled.as_text().count(" dot(")
  assert n_dots["dots"] == n_dots["none"] < n_dots["dots_no_batch"] < n_dots["full"], n_dots
  for policy in ("dots", "dots_no_batch", "full"):
    for a, b in zip(jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["cpu", "plain"])
@pytest.mark.parametrize("shape", [(32, 8), (8, 32)])
def test_mm_gradients_match_plain_matmul(shape, form):
  """mm's CPU form takes the weight gradient of a narrowing matrix (more rows than
  columns, the MLP's W_proj) transposed; the gradients are the plain matmul's."""
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (3, 5, shape[0]))
  w = jax.random.normal(k2, shape)
  f = lambda x, w: jnp.sum(jnp.sin(mm(x, w, form)))
  r = lambda x, w: jnp.sum(jnp.sin(jnp.einsum("btd,df->btf", x, w)))
  for a, b in zip(jax.grad(f, argnums=(0, 1))(x, w), jax.grad(r, argnums=(0, 1))(x, w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  custom = "custom_vjp" in str(jax.make_jaxpr(f)(x, w))
  assert custom == (shape[0] > shape[1] and form == "cpu")
