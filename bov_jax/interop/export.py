"""A run's weights as a Hugging Face style folder: safetensors, config.json, the run's
config, the tokenizer and a model card.

What `python -m bov_jax.export` writes. The folder (names in rundir.py):
  model.safetensors            every parameter, named by its path in the model
                               (`blocks.3.attn.wq`, `tables.layer_5`, `wte`, `lm_head`;
                               docs/design.md), in the dtype the run stores it (`--dtype`
                               casts floating tensors); above --max_shard_gib, files
                               model-0000k-of-0000n.safetensors and
                               model.safetensors.index.json (`weight_map`), as
                               transformers writes them
  config.json                  Hugging Face style: architectures, model_type, dims,
                               vocabulary, windows, the value mode and its layers
  run_config.json              the run's whole config (bov_jax reads it back)
  tokenizer.pkl, token_bytes.npy   the authors' tokenizer files, as the run has them
  tokenizer.json               the same tokenizer in the `tokenizers` library's format
                               (tokenizers.Tokenizer.from_file encodes as bov_jax does)
  tokenizer_config.json        what transformers' AutoTokenizer reads beside tokenizer.json
  generation_config.json       <|bos|> ends a generation (it starts every document)
  configuration_bov_gpt.py,    the model in PyTorch for transformers (hf_code/): config.json's
  modeling_bov_gpt.py          auto_map makes AutoModelForCausalLM.from_pretrained(FOLDER,
                               trust_remote_code=True) build it
  README.md                    a model card: value mode, tokens trained, last metrics

Tensors are fetched and written one at a time, so a sharded run is never gathered whole
on one host.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from bov_jax.data import tokenizer as tok_lib
from bov_jax.model import combine
from bov_jax.model import gpt as model_lib
from bov_jax.model import loss
from bov_jax.run import spec as spec_lib
from bov_jax.settings import values
from bov_jax.store import checkpoint
from bov_jax.store import rundir
from bov_jax.store import safetensors

# The PyTorch model written into every folder (read as files, never imported: torch is an extra).
HF_CODE = pathlib.Path(__file__).parent / "hf_code"
HF_FILES = ("configuration_bov_gpt.py", "modeling_bov_gpt.py")
AUTO_MAP = {"AutoConfig": "configuration_bov_gpt.BovGPTConfig",
            "AutoModel": "modeling_bov_gpt.BovGPTModel",
            "AutoModelForCausalLM": "modeling_bov_gpt.BovGPTForCausalLM"}


def hf_config(m, dtype: str, step: int, bos_id: int) -> dict:
  """config.json in the Hugging Face style, from the resolved model spec `m`: what
  hf_code/'s BovGPTConfig reads, the forward's constants bov_jax's own."""
  mode = m.value
  return {"architectures": ["BovGPTForCausalLM"], "model_type": "bov_gpt", "auto_map": AUTO_MAP,
          "hidden_size": m.n_embd, "num_hidden_layers": m.n_layer,
          "num_attention_heads": m.n_head, "num_key_value_heads": m.n_kv_head,
          "head_dim": m.head_dim, "vocab_size": m.vocab_size,
          "padded_vocab_size": m.padded_vocab,
          "max_position_embeddings": m.sequence_len, "window_sizes": list(m.windows),
          "value_mode": {"preset": mode.preset, "source": mode.source,
                         "combine": mode.combine, "coeff": mode.coeff,
                         "layers": mode.layers, "shared_table": mode.shared_table},
          "value_layers": list(m.target_layers),
          "rope_theta": model_lib.ROPE_BASE, "logit_softcap": loss.SOFTCAP,
          "qk_norm_scale": model_lib.QK_NORM_SCALE, "smear_channels": model_lib.SMEAR_CHANNELS,
          "gate_channels": values.GATE_CHANNELS, "gate_scale": combine.GATE_SCALE,
          "bos_token_id": bos_id, "eos_token_id": bos_id, "pad_token_id": bos_id,
          "tie_word_embeddings": False, "use_cache": True,
          "dtype": dtype, "step": step, "bov_jax_version": _version()}


def tokenizer_config(tok) -> dict:
  """tokenizer_config.json: tokenizer.json read by transformers' own fast tokenizer, with
  <|bos|> as its bos, eos and padding token (nanochat separates documents with it)."""
  return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok_lib.BOS,
          "eos_token": tok_lib.BOS, "pad_token": tok_lib.BOS, "add_bos_token": True,
          "model_max_length": None, "clean_up_tokenization_spaces": False}


def _version() -> str:
  from importlib import metadata
  try:
    return metadata.version("bov_jax")
  except metadata.PackageNotFoundError:
    return "unknown"


def model_card(m, metrics: list[dict], step: int) -> str:
  """README.md: what the model is and how it did, from the run's metrics (the Hub reads
  the front matter's library name and tags)."""
  mode = m.value
  last = metrics[-1] if metrics else {}
  bpb = next((r["val_bpb"] for r in reversed(metrics) if "val_bpb" in r), None)
  core = next((r["core"] for r in reversed(metrics) if "core" in r), None)
  lines = ["---", "library_name: transformers", "tags: [bov_jax, bank-of-values]", "---", "",
           f"# bov_jax model: {mode.preset or 'custom value mode'}", "",
           "A GPT-style language model trained with bov_jax (Bank of Values), "
           f"{m.n_layer} layers, width {m.n_embd}, vocabulary "
           f"{m.vocab_size}, context {m.sequence_len}.", "",
           f"- value mode: source {mode.source}, combine {mode.combine}, coefficient "
           f"{mode.coeff}, layers {list(m.target_layers)}",
           f"- checkpoint step: {step}; tokens trained: {last.get('tokens', 'unknown')}",
           f"- final validation bits per byte: {bpb if bpb is not None else 'not measured'}",
           f"- CORE: {core if core is not None else 'not measured'}", "",
           "## Use", "",
           "With PyTorch and Hugging Face transformers 5 (the modeling code ships in this "
           "folder, hence `trust_remote_code=True`):", "", "```python",
           "from transformers import AutoModelForCausalLM, AutoTokenizer",
           "model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)",
           "tok = AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=True)  # or it asks",
           "ids = tok(\"The capital of France is\", return_tensors=\"pt\").input_ids",
           "print(tok.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0]))",
           "```", "",
           "With bov_jax: `python -m bov_jax.main --workdir=FOLDER --mode=sample` (or "
           "`--mode=eval`, `python -m bov_jax.lm_eval --workdir=FOLDER`).", "",
           "Files: `model.safetensors` (or its shards and index), `config.json`, "
           "`run_config.json` (the run's whole config), `tokenizer.json` (the `tokenizers` "
           "library's format) and `tokenizer.pkl` (the authors' tiktoken file), "
           "`configuration_bov_gpt.py` and `modeling_bov_gpt.py` (the model in PyTorch). "
           "Tensor names: bov_jax's docs/design.md.", ""]
  return "\n".join(lines)


def export(workdir: str, out: str, step: int | None = None, dtype: str | None = None,
           max_shard_bytes: int = 5 * 2**30) -> dict:
  """Writes the folder; returns {"out", "step", "files"}: every file written, the weights'
  first."""
  cfg = rundir.config_of(workdir)
  model = spec_lib.model_of(cfg)
  abstract = nnx.to_pure_dict(nnx.state(model_lib.abstract(model)))
  with checkpoint.Checkpoints(workdir, async_save=False) as ckpts:
    restored = ckpts.restore(abstract, only=step)
  if restored is None:
    raise FileNotFoundError(f"no checkpoint under {rundir.checkpoints(workdir)}")
  leaves = safetensors.tensor_names(restored.params)

  def fetch(name):  # one tensor on the host at a time (all processes join each gather)
    x = leaves[name]
    return np.asarray(multihost_utils.process_allgather(x, tiled=True)
                      if jax.process_count() > 1 else x)

  files = safetensors.write_weights(out, restored.params, dtype, max_shard_bytes, fetch)
  root = epath.Path(out)
  stored = str(np.dtype(leaves["lm_head"].dtype))
  tok = tok_lib.load(rundir.tokenizer(workdir))
  hf = hf_config(model, dtype or stored, int(restored.step), tok.bos_id)
  (root / rundir.EXPORT_CONFIG).write_text(json.dumps(hf, indent=2))
  (root / rundir.RUN_CONFIG).write_text(cfg.to_json(indent=2))
  tok.save(str(root))
  (root / rundir.EXPORT_TOKENIZER).write_text(json.dumps(tok_lib.hf_json(tok)))
  (root / rundir.EXPORT_TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(tok), indent=2))
  generation = {"bos_token_id": tok.bos_id, "eos_token_id": tok.bos_id,
                "pad_token_id": tok.bos_id}
  (root / rundir.EXPORT_GENERATION).write_text(json.dumps(generation, indent=2))
  for name in HF_FILES:
    (root / name).write_text((HF_CODE / name).read_text())
  records = rundir.read_metrics(workdir) or []
  (root / rundir.MODEL_CARD).write_text(model_card(model, records, restored.step))
  written = [str(root / n) for n in (rundir.EXPORT_CONFIG, rundir.RUN_CONFIG, tok_lib.PICKLE,
                                     tok_lib.TOKEN_BYTES, rundir.EXPORT_TOKENIZER,
                                     rundir.EXPORT_TOKENIZER_CONFIG, rundir.EXPORT_GENERATION,
                                     *HF_FILES, rundir.MODEL_CARD)]
  return {"out": str(root), "step": int(restored.step), "files": files + written}
