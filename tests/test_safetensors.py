"""store/safetensors.py: parameters as safetensors files and back, bit for bit, named as
docs/design.md documents."""
import json
import os

import numpy as np
import pytest
from flax import nnx

from bov_jax.settings import values
from bov_jax.store import rundir
from bov_jax.store import safetensors as safetensors_lib
from tests.conftest import ROOT
from tests.helpers import equal_bits
from tests.helpers import random_model
from tests.helpers import small_config
from tests.helpers import weights_dict


def test_weights_round_trip_bit_for_bit_in_one_file_and_in_shards(tmp_path):
  params = weights_dict()
  (one,) = safetensors_lib.write_weights(str(tmp_path / "one"), params)
  assert one.endswith(rundir.EXPORT_WEIGHTS)
  equal_bits(safetensors_lib.read_weights(str(tmp_path / "one")), params)
  files = safetensors_lib.write_weights(str(tmp_path / "many"), params, max_shard_bytes=100)
  assert len(files) > 1 and files[0].endswith("model-00001-of-0000%d.safetensors" % len(files))
  index = json.loads((tmp_path / "many" / rundir.EXPORT_INDEX).read_text())
  assert set(index["weight_map"]) == set(safetensors_lib.tensor_names(params))
  equal_bits(safetensors_lib.read_weights(str(tmp_path / "many")), params)


def test_the_safetensors_library_reads_the_files(tmp_path):
  import safetensors  # the dev extra installs it: the files must read in the library itself
  params = weights_dict()
  safetensors_lib.write_weights(str(tmp_path), params)
  with safetensors.safe_open(str(tmp_path / rundir.EXPORT_WEIGHTS), framework="flax") as f:
    assert sorted(f.keys()) == sorted(safetensors_lib.tensor_names(params))
    got = np.asarray(f.get_tensor("blocks.1.attn.wq"))
    np.testing.assert_array_equal(got, params["blocks"][1]["attn"]["wq"])
    assert str(f.get_tensor("wte").dtype) == "bfloat16"


def _documented_names() -> list:
  """docs/design.md's table of tensor names as regexes: `blocks.<i>.attn.wq`, `wk`
  (a short name replaces the last part), `<i>` a layer, `<a, b>` one of them."""
  import re
  text = open(os.path.join(ROOT, "docs", "design.md")).read()
  table = text[text.index("| name | shape | what |"):].split("\n\n")[0].splitlines()[2:]
  patterns = []
  for row in table:
    names = re.findall(r"`([^`]+)`", row.split("|")[1])
    for n in names:
      short = n != names[0] and "." in names[0] and "." not in n
      full = names[0].rsplit(".", 1)[0] + "." + n if short else n
      rx = re.escape(full).replace(re.escape("<i>"), r"\d+")
      rx = re.sub(r"<([^>]+)>", lambda m: "(" + "|".join(
          x.strip() for x in m.group(1).split(",")) + ")", rx.replace("\\<", "<").replace(
          "\\>", ">").replace("\\ ", " "))
      patterns.append(re.compile(rx + "$"))
  return patterns


@pytest.mark.parametrize("preset", sorted(values.PRESETS))
def test_every_tensor_is_named_in_the_documented_scheme(tmp_path, preset):
  """The baseline and every variant, exported, load with safetensors.numpy.load_file;
  every tensor's name is one of docs/design.md's, and a table source has its tables."""
  import re

  from safetensors.numpy import load_file
  cfg = small_config(preset, vocab_size=128)
  params = nnx.to_pure_dict(nnx.state(random_model(cfg)))
  safetensors_lib.write_weights(str(tmp_path), params, dtype="float32")
  loaded = load_file(str(tmp_path / rundir.EXPORT_WEIGHTS))
  patterns = _documented_names()
  assert len(patterns) >= 12
  assert sorted(loaded) == sorted(safetensors_lib.tensor_names(params))
  for name in loaded:
    assert any(p.match(name) for p in patterns), f"{name} is not in docs/design.md's table"
  tables = [n for n in loaded if n.startswith("tables.")]
  assert bool(tables) == (values.PRESETS[preset]["source"] == "table")
  assert all(re.fullmatch(r"tables\.(layer_[0-5]|shared)", n) for n in tables)
  assert loaded["wte"].shape == (128, 64)


def test_dtype_casts_floating_tensors(tmp_path):
  safetensors_lib.write_weights(str(tmp_path), weights_dict(), dtype="bfloat16")
  back = safetensors_lib.tensor_names(safetensors_lib.read_weights(str(tmp_path)))
  assert {str(v.dtype) for v in back.values()} == {"bfloat16"}
