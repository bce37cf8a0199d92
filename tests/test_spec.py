"""spec.resolve: the config checked once and every `auto` resolved for the backend."""
import dataclasses

import pytest

from bov_jax import config as config_lib
from bov_jax import spec as spec_lib
from tests.helpers import small_config


@pytest.mark.parametrize("backend, attention, decode, chunk, gram, batched", [
    ("cpu", "blocks", "xla", 256, True, False),
    ("gpu", "cudnn", "xla", 2048, False, True),
    ("tpu", "splash", "fused_if_compiles", 2048, False, True),
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
  m = spec_lib.resolve(small_config(attention="splash", sequence_len=128), backend).model
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
  assert [lv.is_bank for lv in s.model.layers] == [False] * 4 + [True] * 2
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
