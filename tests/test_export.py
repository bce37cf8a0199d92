"""export.py: a run's weights as a Hugging Face style folder, and back, bit for bit."""
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from bov_jax import checkpoint
from bov_jax import export
from bov_jax import rundir
from bov_jax import tokenizer as tok_lib
from bov_jax import values
from tests.helpers import ROOT
from tests.helpers import random_model
from tests.helpers import small_config
from tests.helpers import xla_flags


def _params():
  rng = np.random.default_rng(0)
  return {"wte": rng.standard_normal((10, 4)).astype(ml_dtypes.bfloat16),
          "blocks": {0: {"attn": {"wq": rng.standard_normal((4, 4)).astype(np.float32)}},
                     1: {"attn": {"wq": rng.standard_normal((4, 4)).astype(np.float32)}}},
          "tables": {"layer_1": rng.standard_normal((10, 4)).astype(ml_dtypes.bfloat16)}}


def _equal_bits(a: dict, b: dict):
  fa, fb = export.tensor_names(a), export.tensor_names(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    x, y = np.asarray(fa[k]), np.asarray(fb[k])
    assert x.dtype == y.dtype and x.shape == y.shape, k
    assert x.tobytes() == y.tobytes(), k


def test_weights_round_trip_bit_for_bit_in_one_file_and_in_shards(tmp_path):
  params = _params()
  (one,) = export.write_weights(str(tmp_path / "one"), params)
  assert one.endswith(rundir.EXPORT_WEIGHTS)
  _equal_bits(export.read_weights(str(tmp_path / "one")), params)
  files = export.write_weights(str(tmp_path / "many"), params, max_shard_bytes=100)
  assert len(files) > 1 and files[0].endswith("model-00001-of-0000%d.safetensors" % len(files))
  index = json.loads((tmp_path / "many" / rundir.EXPORT_INDEX).read_text())
  assert set(index["weight_map"]) == set(export.tensor_names(params))
  _equal_bits(export.read_weights(str(tmp_path / "many")), params)


def test_the_safetensors_library_reads_the_files(tmp_path):
  import safetensors  # the dev extra installs it: the files must read in the library itself
  params = _params()
  export.write_weights(str(tmp_path), params)
  with safetensors.safe_open(str(tmp_path / rundir.EXPORT_WEIGHTS), framework="flax") as f:
    assert sorted(f.keys()) == sorted(export.tensor_names(params))
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
  export.write_weights(str(tmp_path), params, dtype="float32")
  loaded = load_file(str(tmp_path / rundir.EXPORT_WEIGHTS))
  patterns = _documented_names()
  assert len(patterns) >= 12
  assert sorted(loaded) == sorted(export.tensor_names(params))
  for name in loaded:
    assert any(p.match(name) for p in patterns), f"{name} is not in docs/design.md's table"
  tables = [n for n in loaded if n.startswith("tables.")]
  assert bool(tables) == (values.PRESETS[preset]["source"] == "table")
  assert all(re.fullmatch(r"tables\.(layer_[0-5]|shared)", n) for n in tables)
  assert loaded["wte"].shape == (128, 64)


def test_dtype_casts_floating_tensors(tmp_path):
  export.write_weights(str(tmp_path), _params(), dtype="bfloat16")
  back = export.tensor_names(export.read_weights(str(tmp_path)))
  assert {str(v.dtype) for v in back.values()} == {"bfloat16"}


@pytest.mark.slow
def test_export_command_writes_the_folder_and_the_modes_read_it(tmp_path):
  """A run directory's checkpoint exported: the weights equal the checkpoint's bit for
  bit, config.json names the value mode and its layers, run_config.json is the run's;
  --mode=sample on the folder continues a prompt as on the run directory."""
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=300)
  wd = str(tmp_path / "run")
  params = nnx.to_pure_dict(nnx.state(random_model(cfg)))
  checkpoint.save_params(wd, cfg, params, step=7)
  from bov_jax import corpus
  texts = tok_lib.training_texts(corpus.embedded_documents()[:400], 300_000)
  tok_lib.train(texts, 300).save(rundir.tokenizer(wd))
  out = subprocess.run([sys.executable, "-m", "bov_jax.export", f"--workdir={wd}",
                        f"--out={tmp_path / 'hf'}"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["step"] == 7
  _equal_bits(export.read_weights(str(tmp_path / "hf")), params)
  hf = json.loads((tmp_path / "hf" / rundir.EXPORT_CONFIG).read_text())
  assert hf["model_type"] == "bov_gpt" and hf["num_hidden_layers"] == cfg.model.n_layer
  assert hf["value_mode"]["source"] == "table" and hf["value_layers"] == [4, 5]
  run_cfg = json.loads((tmp_path / "hf" / rundir.RUN_CONFIG).read_text())
  assert run_cfg["model"]["n_layer"] == cfg.model.n_layer
  tok = tok_lib.load(str(tmp_path / "hf"))
  assert tok.vocab_size == 300
  import tokenizers
  hf_tok = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / rundir.EXPORT_TOKENIZER))
  for text in ("def f(x):\n    return x ** 2", "  ünïcode 12345 'll\n\n"):
    assert hf_tok.encode(text).ids == tok.encode(text)
  assert "source table" in (tmp_path / "hf" / rundir.MODEL_CARD).read_text()
  # the modes read the folder as they read the run directory: the same greedy sample
  sample = ["--mode=sample", "--config.sample.max_new_tokens=6", "--config.sample.temperature=0",
            "--config.sample.prompt=def f"]
  outs = [subprocess.run([sys.executable, "-m", "bov_jax.main", f"--workdir={d}", *sample],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
          for d in (wd, str(tmp_path / "hf"))]
  for o in outs:
    assert o.returncode == 0, o.stderr[-2000:]
  tokens = [json.loads(o.stdout.strip().splitlines()[-1])["tokens"] for o in outs]
  assert tokens[0] == tokens[1] and len(tokens[0]) == 6
  # and --mode=eval: the folder's validation bpb is the run's (written beside each)
  one_device = dict(os.environ, XLA_FLAGS=xla_flags(1))
  outs = [subprocess.run([sys.executable, "-m", "bov_jax.main", f"--workdir={d}", "--mode=eval",
                          "--config.train.eval_tokens=2048"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env=one_device)
          for d in (wd, str(tmp_path / "hf"))]
  for o in outs:
    assert o.returncode == 0, o.stderr[-2000:]
  bpb = [json.loads(o.stdout.strip().splitlines()[-1])["val_bpb"] for o in outs]
  assert abs(bpb[0] - bpb[1]) <= 1e-6 and 0 < bpb[0] < 20
  assert json.loads((tmp_path / "hf" / rundir.EVAL).read_text())["val_bpb"] == bpb[1]


def test_a_new_run_starts_from_an_exported_folder(tmp_path):
  """model.init_from: the folder's weights, bit for bit, placed as the run's parameters;
  a folder of another shape is refused naming the tensors that differ."""
  import jax

  from bov_jax import train
  params = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), _params())
  export.write_weights(str(tmp_path / "f"), _params())
  _equal_bits(train._weights_from(str(tmp_path / "f"), params), _params())
  other = dict(_params(), wte=np.zeros((11, 4), ml_dtypes.bfloat16))
  export.write_weights(str(tmp_path / "g"), other)
  with pytest.raises(export.ExportError, match=r"model\.init_from=.*\['wte'\]"):
    train._weights_from(str(tmp_path / "g"), params)
