"""The fused bank-layer decode kernel: equal to gathering the values and attending,
whole or over a vocab-split table, inside generation, and lowerable for TPU."""
import contextlib
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from bov_jax.inference import generate as inference
from bov_jax.kernels import attention
from bov_jax.kernels import bank_decode
from bov_jax.kernels import bank_decode_tpu
from bov_jax.model import kvcache
from bov_jax.model import params as params_lib
from bov_jax.parallel import lookup
from bov_jax.parallel import sharding
from bov_jax.run import spec as spec_lib
from bov_jax.settings import config as config_lib
from tests.helpers import model_spec
from tests.helpers import random_model
from tests.helpers import run_spec
from tests.helpers import small_config


@dataclasses.dataclass
class Case:
  B: int = 3
  K: int = 2
  G: int = 2
  E: int = 128
  S: int = 512
  V: int = 192


def _case(kernel):
  """TPU: four 128-position blocks, each a grid step. GPU: 2,048 positions, so each
  of the 16 splits runs two 64-position blocks through its online softmax."""
  return Case() if kernel == "tpu" else Case(S=2048)


def _inputs(c: Case, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(c.B, 1, c.K * c.G, c.E)), dtype)
  k = jnp.asarray(rng.normal(size=(c.B * c.K, c.S, c.E)), dtype)
  ids = jnp.asarray(rng.integers(0, c.V, size=(c.B, c.S)), jnp.int32)
  table = jnp.asarray(rng.normal(size=(c.V, c.K * c.E)), jnp.float32)
  # the first row; a block's last; most of the cache (TPU: four blocks, their rows
  # requested a block ahead)
  qpos = jnp.asarray([0, 127, c.S - 62][:c.B], jnp.int32)
  return q, k, ids, table, qpos


def _gather_then_attend(q, k, ids, table, qpos, window, gamma):
  B, S = ids.shape
  K = k.shape[0] // B
  rows = (gamma * table[ids]).reshape(B, S, K, -1).astype(k.dtype)
  return attention.attend(q, k, attention.kv_rows(rows), qpos[:, None],
                          jnp.broadcast_to(jnp.arange(S), (B, S)), window)


KERNELS = ["tpu", "gpu"]  # each runs in the Pallas interpreter here


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("window", [10_000, 100, 3])
def test_fused_step_equals_gather_then_attend(window, kernel):
  """Full causal, a window that starts mid-block and crosses a block edge, and one
  that sees four keys; a query at position 0 sees only itself."""
  c = _case(kernel)
  q, k, ids, table, qpos = _inputs(c)
  gamma = jnp.float32(0.7)
  got = jax.jit(lambda *a: bank_decode.attend(*a, window=window, gamma=gamma, kernel=kernel,
                                              interpret=True))(
      q, k, ids, table, qpos)
  want = _gather_then_attend(q, k, ids, table, qpos, window, gamma)
  assert got.shape == (c.B, 1, c.K * c.G * c.E)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_gpu_kernel_pads_query_heads_to_a_power_of_two():
  """24 query heads on one kv head: the GPU kernel's rows pad to 32 (Triton's
  tensor shapes), the output keeps 24."""
  c = Case(B=2, K=1, G=24, E=64, S=256)
  q, k, ids, table, qpos = _inputs(c, seed=3)
  got = jax.jit(lambda *a: bank_decode.attend(*a, window=50, kernel="gpu", interpret=True))(
      q, k, ids, table, qpos)
  want = _gather_then_attend(q, k, ids, table, qpos, 50, 1.0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_positions_past_the_query_do_not_count(kernel):
  """Slots after the query's position hold stale keys and ids; changing them
  changes nothing (the causal test hides them, and their blocks are skipped)."""
  c = Case(B=1)
  q, k, ids, table, _ = _inputs(c)
  qpos = jnp.asarray([130], jnp.int32)
  f = jax.jit(lambda *a: bank_decode.attend(*a, window=10_000, kernel=kernel, interpret=True))
  a = f(q, k, ids, table, qpos)
  b = f(q, k.at[:, 131:].set(50.0), ids.at[:, 131:].set(0), table, qpos)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _mesh(shape):
  cfg = small_config()
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = shape
  return sharding.make_mesh(cfg.mesh)


def _fused(m, i, batch, context):
  """Whether layer i of model m decodes through the kernel (kvcache's choice)."""
  ls = kvcache.layer_settings(m.spec, m.spec.layers[i], m.spec.windows[i])
  table = m.table(i)
  return kvcache.fused_bank(ls, batch, context, None if table is None else table.shape)


@pytest.mark.parametrize("kernel, shape, batch", [
    ("tpu", (1, 1, 8), 3),  # vocabulary over tensor; 3 sequences are not split
    ("tpu", (2, 1, 4), 3),  # the same, a data axis beside it
    ("tpu", (2, 1, 4), 4),  # sequences over data, vocabulary over tensor
    ("gpu", (2, 1, 4), 4)])
def test_vocab_split_table_equals_whole(kernel, shape, batch):
  """Under a mesh the table's vocabulary is split over tensor (RULES); each shard
  gathers its own rows and the partial outputs add up to the whole. A batch split
  over other axes runs per shard."""
  c = Case(B=batch, V=256)
  q, k, ids, table, qpos = _inputs(c, seed=1)
  if batch == 4:
    qpos = jnp.asarray([0, 127, 300, 511], jnp.int32)
  mesh = _mesh(shape)
  spec = sharding.logical_to_spec(("table_vocab", "table_width"), table.shape, mesh)
  assert spec[0] is not None  # the case under test: a split vocabulary
  want = _gather_then_attend(q, k, ids, table, qpos, 100, 1.0)
  with jax.set_mesh(mesh):
    assert bank_decode.mesh_split(batch, table.shape) == (
        (("data",) if batch == 4 else ()), lookup.table_axes(mesh, table.shape)[0])
    t = jax.device_put(table, NamedSharding(mesh, spec))
    got = jax.jit(lambda *a: bank_decode.attend(*a, window=100, kernel=kernel, interpret=True))(
        q, k, ids, t, qpos)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_a_table_split_over_its_width_takes_xla():
  """fsdp splits the table's width (and the batch): no device holds a whole row, so
  the decode step keeps XLA's lookup, which moves rows."""
  with jax.set_mesh(_mesh((1, 8, 1))):
    for batch in (8, 1):
      assert bank_decode.mesh_split(batch, (256, 256)) is None
      assert bank_decode.kernel_for("fused", 256, 128, False, batch, (256, 256)) == "xla"
  with jax.set_mesh(_mesh((8, 1, 1))):  # data parallel: tables whole on every device
    assert bank_decode.kernel_for("fused", 256, 128, False, 8, (256, 256)) == "fused"


def test_auto_takes_the_tpu_kernel_only_where_it_compiles(monkeypatch, caplog):
  """For a TPU target, `auto` is decided once, when the run spec is resolved for its
  target device (`bank_decode.resolve`, called by spec.resolve): the kernel is compiled
  once for that device per bank layer's window (Mosaic's own compile), and where it does
  not compile, decoding keeps XLA's gather and a warning names the setting. Here the
  target is this CPU: the kernel compiled for it, not interpreted, fails as a kernel
  Mosaic rejects would, and the interpreted one compiles. A trace never meets the
  undecided setting."""
  from bov_jax.settings import model_spec as model_spec_lib
  cfg = small_config(sequence_len=128, n_embd=256, n_head=2, n_kv_head=1)
  spec = model_spec_lib.model_spec(cfg.model, "tpu")
  assert spec.decode_attention == "fused_if_compiles"
  assert spec_lib.model_of(cfg, backend="gpu").decode_attention == "xla"
  assert spec_lib.model_of(cfg, backend="tpu").decode_attention == "xla"  # no TPU to ask
  windows = {w for layer_value, w in zip(spec.layers, spec.windows) if layer_value.is_bank}
  bank_decode.compiles.cache_clear()
  with caplog.at_level(logging.WARNING):
    assert bank_decode.resolve(spec, jax.devices()[0]).decode_attention == "xla"
  assert "model.decode_attention=auto" in caplog.text
  real = bank_decode_tpu.call
  monkeypatch.setattr(bank_decode_tpu, "call",
                      lambda *a, interpret, **kw: real(*a, interpret=True, **kw))
  bank_decode.compiles.cache_clear()
  assert bank_decode.resolve(spec, jax.devices()[0]).decode_attention == "fused"
  assert bank_decode.compiles.cache_info().misses == len(windows)
  resolved = spec_lib.resolve(cfg, backend="tpu", n_devices=1, device=jax.devices()[0])
  assert resolved.model.decode_attention == resolved.sample_model.decode_attention == "fused"
  assert bank_decode.resolve(dataclasses.replace(spec, decode_attention="xla")) \
      .decode_attention == "xla"
  with pytest.raises(ValueError, match="before tracing"):
    bank_decode.kernel_for("fused_if_compiles", 256, 128, False)
  bank_decode.compiles.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("B, K", [(3, 2), (3, 1)])
def test_dmas_and_semaphores_as_a_tpu_runs_them(cores, B, K):
  """Pallas's TPU interpreter, which carries out DMAs and semaphore waits the way
  the chip orders them (the plain interpreter copies at `start`), with one or two
  cores (a megacore chip runs each half of the rows on its own core, here in a
  random order) and its race detector on, sees the same output: no block reads
  rows before their DMAs have landed, and the rows requested ahead (the next
  block, or at a row's last block the next row's first) go to the half of the
  buffer not being read. Six rows split over two cores; three (K = 1) cannot
  be, and run on one."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  from jax.experimental.pallas import tpu as pltpu
  c = Case(B=B, K=K)
  q, k, ids, table, qpos = _inputs(c, seed=2)
  N = c.B * c.K
  params = pltpu.InterpretParams(num_cores_or_threads=cores, detect_races=True, random_seed=3)
  got = bank_decode_tpu.call(q.reshape(N, c.G, c.E), k, ids, table, qpos,
                             jnp.zeros((1,), jnp.int32), window=300, split=True,
                             interpret=params)
  want = _gather_then_attend(q, k, ids, table, qpos, 300, 1.0)
  np.testing.assert_allclose(np.asarray(got).reshape(want.shape), np.asarray(want),
                             atol=2e-6, rtol=1e-5)
  assert not interpret_pallas_call.races.races_found


TRITON = "__gpu$xla.gpu.triton"
LOWERED = {  # kernel -> (call, export platform, custom call in the module, checks to lift)
    "tpu": (bank_decode.tpu.call, "tpu", "tpu_custom_call", []),
    "gpu": (bank_decode.gpu.call, "cuda", f"custom_call @{TRITON}",
            [jax.export.DisabledSafetyCheck.custom_call(TRITON)]),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("split", [False, True])
def test_kernel_lowers_for_its_backend(kernel, split):
  """Pallas's lowering runs on any host through jax.export. TPU's checks block
  shapes against (8, 128) tiles, the SMEM blocks and the DMA slices (Mosaic's own
  compile needs a TPU); GPU's builds the Triton module (power-of-two tensors, the
  gather load, dot sizes; compiling it needs a GPU)."""
  call, platform, marker, lifted = LOWERED[kernel]
  c = Case()
  q, k, ids, table, qpos = _inputs(c, dtype=jnp.bfloat16)
  N = c.B * c.K

  def f(q, k, ids, table, qpos):
    return call(q.reshape(N, c.G, c.E), k, ids, table, qpos, jnp.zeros((1,), jnp.int32),
                window=100, split=split, interpret=False)

  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, ids, table, qpos)]
  exported = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=lifted)
  with _target(platform):
    assert marker in exported(*shapes).mlir_module()


def _target(platform):
  """The chip a lowering is for where the lowering asks (Triton: the GPU's compute
  capability, read from the mesh's abstract device when no GPU is attached)."""
  if platform != "cuda":
    return contextlib.nullcontext()
  h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h200))


def _bov(decode_attention, backend=None):
  """A BoV model of three layers (the bank is layer 2), random weights (the output
  projections, zero at init, must pass the values on): head dim 128 (the TPU kernel's
  lanes), two query heads on one kv head."""
  return nnx.split(random_model(_bov_config(decode_attention), scale=0.1, backend=backend))


def _bov_config(decode_attention):
  cfg = small_config(sequence_len=128, n_embd=256, n_head=2, n_kv_head=1, n_layer=3)
  cfg.model.decode_attention = decode_attention
  return cfg


@pytest.mark.slow
def test_generation_with_the_kernel_equals_xla():
  """A BoV model (its bank in layer 2, GQA, 8-token sliding windows) decodes the same
  tokens, and each step the same logits, with either path."""
  g_xla, state = _bov("xla")
  g_fused, _ = _bov("fused")
  params = nnx.to_pure_dict(state)
  assert _fused(nnx.merge(g_fused, state), 2, 2, 128)
  assert not _fused(nnx.merge(g_fused, state), 1, 2, 128)  # stores its values
  prompts = jnp.asarray([[5, 17, 3, 99, 0, 0], [8, 1, 2, 3, 4, 5]], jnp.int32)
  lengths = jnp.asarray([4, 6])
  run = lambda g: np.asarray(inference.generate(g, params, prompts, lengths, jax.random.key(0),
                                                context=128, max_new_tokens=24))
  np.testing.assert_array_equal(run(g_fused), run(g_xla))

  @jax.jit
  def steps(s, toks):
    out = []
    for g in (g_xla, g_fused):
      m = nnx.merge(g, s)
      logits, cache = m(prompts, kvcache.init(m, 2, 128))
      for t in range(toks.shape[1]):
        logits, cache = m(toks[:, t:t + 1], cache)
      out.append(logits)
    return out

  a, b = steps(state, jnp.asarray([[7, 9, 11], [2, 4, 6]], jnp.int32))
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_generation_on_a_mesh_with_the_kernel_equals_xla():
  """Sample mode's setting: parameters sharded by the rules over a 2x1x4 mesh (the
  tables' vocabulary over tensor), one sequence; the kernel runs per vocab shard
  and the tokens match XLA's sharded lookup."""
  mesh = _mesh((2, 1, 4))
  out = {}
  for impl in ("xla", "fused"):
    graphdef, state = _bov(impl)
    _, _, shardings = params_lib.abstract_params(model_spec(_bov_config(impl)), mesh)
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    with jax.set_mesh(mesh):
      assert params["tables"]["layer_2"].sharding.spec[0] == "tensor"
      out[impl] = inference.generate_cached(graphdef, params, [5, 17, 3, 99], 20, 128)
  assert out["fused"] == out["xla"] and len(out["xla"]) == 20


def test_kernel_choice_and_config():
  assert run_spec(small_config(decode_attention="auto"), backend="cpu").model.decode_attention == "xla"
  assert bank_decode.kernel_for("xla", 256, 128, False) == "xla"  # the gather path
  assert bank_decode.kernel_for("fused", 256, 128, False) == "fused"
  assert bank_decode.kernel_for("fused", 200, 128, False) == "xla"  # not whole blocks
  assert bank_decode.kernel_for("fused", 256, 128, True) == "xla"  # tables in host memory
  assert bank_decode.fits(1024, 128) and not bank_decode.fits(1024, 64)
  assert bank_decode.fits(1024, 64, "gpu") and not bank_decode.fits(1024, 96, "gpu")
  assert not bank_decode.fits(1000, 64, "gpu")
  cfg = small_config()
  cfg.model.decode_attention = "pallas"
  with pytest.raises(config_lib.ConfigError, match="model.decode_attention='pallas'"):
    run_spec(cfg)
