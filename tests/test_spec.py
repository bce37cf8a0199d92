"""run/spec.py: the config checked once (spec.check), every `auto` resolved for the target,
and the derived settings (learning rates, batch layout, decode kernel) resolved with it."""
import dataclasses

import pytest

from bov_jax.run import spec as spec_lib
from bov_jax.settings import config as config_lib
from tests.helpers import small_config


@pytest.mark.parametrize("backend, attention, decode, chunk, gram, batched", [
    ("cpu", "blocks", "xla", 256, True, False),
    ("gpu", "cudnn", "xla", 2048, False, True),
    ("tpu", "splash", "xla", 2048, False, True),  # no TPU here to compile the fused kernel
])
def test_auto_settings_resolve_per_backend(backend, attention, decode, chunk, gram, batched):
  c = small_config()
  c.model.dtype = "bfloat16"  # cuDNN's flash attention takes half precision (test_attention)
  s = spec_lib.resolve(c, backend)
  assert s.model.attention == attention and s.model.decode_attention == decode
  assert s.model.loss_chunk == chunk and s.model.table_lookup == "shard_map"
  assert s.optim.polar_gram is gram and s.optim.muon_batched is batched
  assert s.optim.polar_dtype == "bfloat16"


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_kernel_forms_are_the_targets_not_the_hosts(backend):
  """Every kernel form is chosen for the backend the spec is resolved for, whatever
  this process runs on: a CPU host resolving for TPU gets the TPU program."""
  m = spec_lib.model_of(small_config(attention="splash", sequence_len=128), backend)
  assert m.platform == backend
  assert m.splash_interpret is (backend != "tpu")
  assert (m.matmul, m.sampler) == (("cpu", "cpu") if backend == "cpu" else ("plain", "jax"))
  assert (m.decode_kernel, m.decode_interpret) == (
      ("gpu", False) if backend == "gpu" else ("tpu", backend != "tpu"))
  assert m.attention_block == 512 and m.scan is (backend != "cpu")


def test_explicit_settings_are_kept():
  c = small_config(attention="xla", loss_chunk=64, table_lookup="one_hot")
  c.optim.polar_gram, c.optim.muon_batched, c.optim.polar_dtype = "true", "false", "float32"
  s = spec_lib.resolve(c, "tpu")
  assert (s.model.attention, s.model.loss_chunk, s.model.table_lookup) == ("xla", 64, "one_hot")
  assert (s.optim.polar_gram, s.optim.muon_batched, s.optim.polar_dtype) == (True, False, "float32")


def test_derived_values_and_frozen():
  c = small_config("gpt_base_v_from_value_emb_learn")
  s = spec_lib.resolve(c)
  assert s.model.windows == (8, 8, 8, 64, 8, 64) and s.model.head_dim == 16
  assert s.model.target_layers == [4, 5] and s.model.value.source == "table"
  assert [layer_value.is_bank for layer_value in s.model.layers] == [False] * 4 + [True] * 2
  hash(s.model)  # a static part of the model: keys jit caches
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.model.n_layer = 3
  with pytest.raises(AttributeError):
    s.train.seed = 1
  c.train.seed = 5  # the spec does not follow later edits of the config
  assert s.train.seed == 0 and spec_lib.resolve(c).train.seed == 5
  assert s.config().train.seed == 0  # and keeps the config it was made from


def test_bad_settings_are_named_before_anything_is_built():
  with pytest.raises(config_lib.ConfigError, match=r"model\.table_lookup='host'"):
    spec_lib.resolve(small_config(table_lookup="host"))  # inference-only, set by sample mode
  with pytest.raises(config_lib.ConfigError, match=r"train\.eval_every=0"):
    c = small_config()
    c.train.eval_every = 0
    spec_lib.resolve(c)


def test_the_effective_learning_rates_are_resolved_with_the_spec():
  """The batch and width scaling (optim.hyperparams) is part of the run spec: the
  optimizer, the plan and the step read it, nothing resolves a reference config again."""
  from bov_jax.optim import optimizer as optim
  from bov_jax.run import plan
  c = small_config()
  c.train.batch_tokens *= 4
  s = spec_lib.resolve(c)
  ref = config_lib.depth_config(12)
  ref.model.vocab_size = c.model.vocab_size
  want = optim.hyperparams(s.optim, c.model.n_embd, c.train.batch_tokens,
                           plan.scaling_params(s.model),
                           plan.scaling_params(spec_lib.resolve(ref, "cpu", 1).model))
  assert s.optim.hyperparams == want
  base = spec_lib.resolve(small_config()).optim.hyperparams
  assert s.optim.hyperparams["muon"] == pytest.approx(2 * base["muon"])  # sqrt(4)


def test_the_batch_layout_is_resolved_for_the_devices_the_run_is_for():
  c = small_config()
  c.train.batch_tokens, c.train.device_batch_size = 64 * 16, 2  # 16 rows of T=64
  one, eight = spec_lib.resolve(c, n_devices=1), spec_lib.resolve(c, n_devices=8)
  assert (one.n_devices, one.batch.rows_per_device, one.batch.accum) == (1, 2, 8)
  assert (eight.n_devices, eight.batch.rows_per_device, eight.batch.accum) == (8, 2, 1)
  assert eight.batch.local_rows == 16  # one process holds all eight devices


@pytest.mark.parametrize("setting, value, n_devices, match", [
    ("mesh.data", 3, 8, r"mesh data=3 .* 8 are available"),
    ("train.batch_tokens", 64 * 12, 8, r"train\.batch_tokens=768 must be a multiple"),
    ("sample.tables_on_host", True, 2, r"sample\.tables_on_host=True .* single device"),
    ("model.value.combine", "gated_add", 1, r"gated_add.* reads 12 channels"),
])
def test_one_check_refuses_what_the_devices_cannot_run(setting, value, n_devices, match):
  """spec.check: everything that needs only the config and the device count, before
  anything is built or written."""
  c = small_config(n_embd=8, n_head=1, n_kv_head=1) if "gated" in str(value) else small_config()
  config_lib.assign(c, setting, value)
  if "gated" in str(value):  # the gated mode of the paper's Table 1, on a table source
    c.model.value.preset, c.model.value.source, c.model.value.coeff = "", "table", "learned"
  with pytest.raises(config_lib.ConfigError, match=match):
    spec_lib.resolve(c, n_devices=n_devices)
