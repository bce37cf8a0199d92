"""attention.py: causal blocks and the Splash kernel (Pallas interpreter on CPU) against
jax.nn's attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bov_jax.kernels import attention
from bov_jax.settings import config as config_lib
from tests.helpers import init_model
from tests.helpers import run_spec
from tests.helpers import small_config


def _qkv(B=1, T=256, H=4, K=2, E=128, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, (B, T, n, E)) for k, n in zip(keys, (H, K, K)))


def _attend(q, k, v, window, impl):
  """self_attend as a CPU-built program runs it (Splash in the Pallas interpreter)."""
  return attention.self_attend(q, k, v, window, impl, interpret=True)


def _loss(impl, window):
  return lambda q, k, v: jnp.sum(jnp.sin(_attend(q, k, v, window, impl)))


def _assert_matches_xla(impl, q, k, v, window):
  """Output and the gradients of q, k and v equal jax.nn's attention's."""
  a = _attend(q, k, v, window, impl)
  b = _attend(q, k, v, window, "xla")
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  ga = jax.grad(_loss(impl, window), argnums=(0, 1, 2))(q, k, v)
  gb = jax.grad(_loss("xla", window), argnums=(0, 1, 2))(q, k, v)
  for x, y in zip(ga, gb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=5e-5)


@pytest.mark.slow
@pytest.mark.parametrize("window", [64, 256])
def test_splash_equals_xla_forward_and_gradients(window):
  _assert_matches_xla("splash", *_qkv(), window)


@pytest.mark.slow
@pytest.mark.parametrize("T, window, H, K", [
    (256, 256, 2, 2),   # causal only: the last query block skips nothing, the first half
    (512, 100, 4, 2),   # a window inside a block, and blocks the window skips; GQA
    (384, 128, 2, 1),   # a window exactly one block wide; MQA
])
def test_blocks_equal_xla_forward_and_gradients(T, window, H, K):
  _assert_matches_xla("blocks", *_qkv(B=2, T=T, H=H, K=K, E=32, seed=T), window)


def test_blocks_in_bfloat16_follow_float32():
  """The hand-written backward keeps each operand's dtype (bf16 in, bf16 gradients)
  and stays within bf16 rounding of the float32 gradients."""
  q, k, v = _qkv(B=2, T=256, H=4, K=2, E=32, seed=3)
  loss = _loss("blocks", 100)
  g32 = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  g16 = jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
  for a, b in zip(g16, g32):
    assert a.dtype == jnp.bfloat16
    err = np.abs(np.asarray(a, np.float32) - np.asarray(b)).max()
    assert err < 0.03 * np.abs(np.asarray(b)).max(), err


def test_blocks_skip_the_key_blocks_outside_the_window():
  """FLOPs in the compiled forward: causal at T=512 computes 10 of 16 score blocks;
  a 100-token window at most two key blocks per query block (7 of 16)."""
  q, k, v = _qkv(B=1, T=512, H=2, K=2, E=32)

  def flops(impl, window):
    f = jax.jit(lambda *a: _attend(*a, window, impl))
    return f.lower(q, k, v).compile().cost_analysis()["flops"]

  full = flops("xla", 512)
  assert flops("blocks", 512) < 0.7 * full
  assert flops("blocks", 100) < 0.5 * full


@pytest.mark.slow
def test_splash_runs_per_shard_on_a_mesh():
  """Batch over data x fsdp, kv heads over tensor: same output and gradients."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  q, k, v = _qkv(B=4)
  want = attention.self_attend(q, k, v, 64, "xla")
  gwant = jax.grad(_loss("xla", 64))(q, k, v)
  with jax.set_mesh(mesh):
    spec = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
    qs, ks, vs = (jax.device_put(x, spec) for x in (q, k, v))
    got = jax.jit(lambda *a: _attend(*a, 64, "splash"))(qs, ks, vs)
    ggot = jax.jit(jax.grad(_loss("splash", 64)))(qs, ks, vs)
    hlo = jax.jit(lambda *a: _attend(*a, 64, "splash")).lower(qs, ks, vs).as_text()
  assert "shard_map" in hlo or "sdy.manual_computation" in hlo
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  np.testing.assert_allclose(np.asarray(ggot), np.asarray(gwant), atol=5e-5)


@pytest.mark.slow
def test_model_with_splash_matches_xla_and_short_sequences_fall_back():
  idx = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 129)), jnp.int32)
  losses = []
  for impl in ("splash", "xla"):
    m = init_model(small_config(sequence_len=128, attention=impl, n_head=2,
                                          n_kv_head=1, n_embd=256), jax.random.key(0))
    losses.append(float(m.loss(idx[:, :-1], idx[:, 1:])))
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
  assert attention.kernel_for("splash", 64) == "xla"      # an evaluation bucket
  assert attention.kernel_for("splash", 256) == "splash"
  auto = {"tpu": "splash", "cpu": "blocks"}.get(jax.default_backend(), "xla")
  assert run_spec(small_config(attention="auto")).model.attention == auto
  assert attention.kernel_for("blocks", 128) == attention.kernel_for("blocks", 200) == "xla"


def test_cudnn_is_chosen_only_where_it_applies():
  """cuDNN on GPU in half precision with head dims it takes; XLA anywhere else
  (jax.nn's own default is XLA, so `auto` must name cuDNN on GPU). Decided in the
  spec, for the target, whatever runs the resolving."""
  def chosen(backend, dtype, n_embd, n_head, attention="cudnn"):
    c = small_config(attention=attention, n_embd=n_embd, n_head=n_head, n_kv_head=n_head)
    c.model.dtype = dtype
    return run_spec(c, backend=backend).model.attention

  assert chosen("gpu", "bfloat16", 256, 2) == chosen("gpu", "float16", 128, 2) == "cudnn"
  assert chosen("gpu", "bfloat16", 256, 2, attention="auto") == "cudnn"
  for backend, dtype, n_embd, n_head in (("cpu", "bfloat16", 256, 2), ("tpu", "bfloat16", 256, 2),
                                         ("gpu", "float32", 256, 2), ("gpu", "bfloat16", 512, 2),
                                         ("gpu", "bfloat16", 72, 2)):
    assert chosen(backend, dtype, n_embd, n_head) == "xla", (backend, dtype, n_embd)
  assert attention.kernel_for("cudnn", 2048) == "cudnn"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
@pytest.mark.parametrize("window, H, K", [(2047, 6, 6), (512, 6, 6), (100, 8, 2)])
def test_cudnn_follows_float32_attention(window, H, K):
  """The d12 shape in bf16 through cuDNN (full causal, the short window, GQA): output
  and gradients within bf16 rounding of XLA's float32 attention, and the compiled
  step really calls cuDNN."""
  q, k, v = _qkv(B=2, T=2048, H=H, K=K, E=128, seed=window)
  hlo = jax.jit(jax.grad(_loss("cudnn", window), argnums=(0, 1, 2))).lower(
      *(x.astype(jnp.bfloat16) for x in (q, k, v))).compile().as_text()
  assert "__cudnn" in hlo  # XLA's own attention compiles to cuBLAS calls only
  with jax.default_matmul_precision("highest"):
    want = attention.self_attend(q, k, v, window, "xla")
    gwant = jax.grad(_loss("xla", window), argnums=(0, 1, 2))(q, k, v)
  b = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
  got = attention.self_attend(*b, window, "cudnn")  # a GPU: the kernel itself
  ggot = jax.grad(_loss("cudnn", window), argnums=(0, 1, 2))(*b)
  for x, y in zip((got, *ggot), (want, *gwant)):
    x, y = np.asarray(x, np.float32), np.asarray(y)
    assert np.linalg.norm(x - y) < 1e-2 * np.linalg.norm(y), np.linalg.norm(x - y) / np.linalg.norm(y)


@pytest.mark.parametrize("settings, message", [
    (dict(attention="flash"), r"model\.attention='flash': expected one of auto, xla, cudnn, blocks, splash"),
    (dict(attention="splash", sequence_len=100), r"multiple of 128.*got 100"),
])
def test_bad_attention_settings_are_named(settings, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    run_spec(small_config(**settings))


@pytest.mark.slow
def test_train_step_with_splash_on_a_mesh_equals_one_device():
  """The whole step (accumulation scan, value tables) with Splash inside: 2x2x2 mesh
  against one device (a kernel cached from one trace must not leak into the next)."""
  from tests.helpers import sgd_step_on_mesh_and_one_device
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=120, sequence_len=128,
                     n_embd=256, n_head=2, n_kv_head=2, n_layer=3, attention="splash")
  idx = jax.random.randint(jax.random.key(3), (2, 4, 129), 0, 120)  # 2 micro-batches of 4 rows
  (want, want_out), (got, out), _ = sgd_step_on_mesh_and_one_device(cfg, idx, (2, 2, 2))
  assert float(out["train_loss"]) == pytest.approx(float(want_out["train_loss"]), rel=1e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
