"""interop/export.py and its command: a run's weights as a Hugging Face style folder that
the modes read back."""
import json

import pytest
from flax import nnx

from bov_jax.data import tokenizer as tok_lib
from bov_jax.interop import export
from bov_jax.model import gpt as model_lib
from bov_jax.run import spec as spec_lib
from bov_jax.store import checkpoint
from bov_jax.store import rundir
from bov_jax.store import safetensors
from tests.helpers import command
from tests.helpers import equal_bits


@pytest.mark.slow
def test_export_command_writes_the_folder_and_the_modes_read_it(copy_run, tmp_path):
  """A finished run's checkpoint exported: the weights equal the checkpoint's bit for
  bit, config.json names the value mode and its layers, run_config.json is the run's;
  --mode=sample and --mode=eval on the folder give what they give on the run directory."""
  wd, hf_dir = copy_run, str(tmp_path / "hf")
  cfg = rundir.config_of(wd)
  model = spec_lib.model_of(cfg)
  abstract = nnx.to_pure_dict(nnx.state(model_lib.abstract(model)))
  params = checkpoint.Checkpoints(wd, async_save=False).restore(abstract).params
  out = command("export", f"--workdir={wd}", f"--out={hf_dir}")
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["step"] == 12
  equal_bits(safetensors.read_weights(hf_dir), params)
  hf = json.loads((tmp_path / "hf" / rundir.EXPORT_CONFIG).read_text())
  assert hf["model_type"] == "bov_gpt" and hf["num_hidden_layers"] == model.n_layer
  assert hf["value_mode"]["source"] == "table" and hf["value_layers"] == model.target_layers
  run_cfg = json.loads((tmp_path / "hf" / rundir.RUN_CONFIG).read_text())
  assert run_cfg["model"]["n_layer"] == model.n_layer
  tok = tok_lib.load(hf_dir)
  assert tok.vocab_size == model.vocab_size
  import tokenizers
  hf_tok = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / rundir.EXPORT_TOKENIZER))
  for text in ("def f(x):\n    return x ** 2", "  ünïcode 12345 'll\n\n"):
    assert hf_tok.encode(text).ids == tok.encode(text)
  assert "source table" in (tmp_path / "hf" / rundir.MODEL_CARD).read_text()
  # the modes read the folder as they read the run directory: the same greedy sample
  sample = ["--mode=sample", "--config.sample.max_new_tokens=6", "--config.sample.temperature=0",
            "--config.sample.prompt=def f"]
  outs = [command("main", f"--workdir={d}", *sample) for d in (wd, hf_dir)]
  for o in outs:
    assert o.returncode == 0, o.stderr[-2000:]
  tokens = [json.loads(o.stdout.strip().splitlines()[-1])["tokens"] for o in outs]
  assert tokens[0] == tokens[1] and len(tokens[0]) == 6
  # and so does Hugging Face transformers, offline, with the modeling code the folder carries
  folder = tmp_path / "hf"
  assert {rundir.EXPORT_TOKENIZER_CONFIG, rundir.EXPORT_GENERATION, *export.HF_FILES} <= {
      p.name for p in folder.iterdir()}
  assert set(hf["auto_map"].values()) == set(export.AUTO_MAP.values())
  import torch
  import transformers
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      hf_dir, trust_remote_code=True, dtype=torch.float32, local_files_only=True)
  hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
  ids = hf_tok("def f", return_tensors="pt").input_ids
  assert ids[0].tolist() == tok.encode("def f")
  greedy = hf_model.generate(ids, max_new_tokens=6, do_sample=False)
  assert greedy[0, ids.shape[1]:].tolist() == tokens[1]
  # and --mode=eval: the folder's validation bpb is the run's (written beside each)
  outs = [command("main", f"--workdir={d}", "--mode=eval", "--config.train.eval_tokens=2048")
          for d in (wd, hf_dir)]
  for o in outs:
    assert o.returncode == 0, o.stderr[-2000:]
  bpb = [json.loads(o.stdout.strip().splitlines()[-1])["val_bpb"] for o in outs]
  assert abs(bpb[0] - bpb[1]) <= 1e-6 and 0 < bpb[0] < 20
  assert json.loads((tmp_path / "hf" / rundir.EVAL).read_text())["val_bpb"] == bpb[1]
