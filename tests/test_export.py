"""interop/export.py and its command: a run's weights as a Hugging Face style folder that the modes read back."""
import json
import os
import subprocess
import sys

import pytest
from flax import nnx

from bov_jax.data import tokenizer as tok_lib
from bov_jax.store import checkpoint
from bov_jax.store import rundir
from bov_jax.store import safetensors
from tests.helpers import ROOT
from tests.helpers import equal_bits
from tests.helpers import random_model
from tests.helpers import small_config
from tests.helpers import xla_flags


@pytest.mark.slow
def test_export_command_writes_the_folder_and_the_modes_read_it(tmp_path):
  """A run directory's checkpoint exported: the weights equal the checkpoint's bit for
  bit, config.json names the value mode and its layers, run_config.json is the run's;
  --mode=sample on the folder continues a prompt as on the run directory."""
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=300)
  wd = str(tmp_path / "run")
  params = nnx.to_pure_dict(nnx.state(random_model(cfg)))
  checkpoint.save_params(wd, cfg, params, step=7)
  from bov_jax.data import corpus
  texts = tok_lib.training_texts(corpus.embedded_documents()[:400], 300_000)
  tok_lib.train(texts, 300).save(rundir.tokenizer(wd))
  out = subprocess.run([sys.executable, "-m", "bov_jax.export", f"--workdir={wd}",
                        f"--out={tmp_path / 'hf'}"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["step"] == 7
  equal_bits(safetensors.read_weights(str(tmp_path / "hf")), params)
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
