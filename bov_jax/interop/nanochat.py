"""Import checkpoints of the reference PyTorch code (nanochat, bank_of_values branch).

`from_nanochat(state_dict, model_type, **dims)` maps the reference's parameter
names (its gpt.py state_dict) onto a bov_jax model. PyTorch Linear
weights are stored [out, in]; ours are [in, out], so they are transposed.

`convert_file` (the command `python -m bov_jax.convert`; torch is imported only to read a
.pt file) writes a bov_jax checkpoint (step from the file name, parameters only), DIR/config.json
and the authors' tokenizer (their tokenizer.pkl) as DIR/tokenizer, so `--workdir=DIR`
modes sample and evaluate through the vocabulary the weights were trained with.
"""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from bov_jax.data import tokenizer as tok_lib
from bov_jax.host import extras
from bov_jax.model import gpt as model_lib
from bov_jax.run import spec as spec_lib
from bov_jax.settings import config as config_lib
from bov_jax.store import checkpoint as ckpt_lib
from bov_jax.store import rundir

DIMS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
        "window_pattern")


class ConversionError(ValueError):
  """A reference checkpoint does not fit the requested model."""


def config_for(model_type: str, **dims):
  missing = [d for d in DIMS if d not in dims]
  if missing:
    raise ConversionError(f"from_nanochat needs the dims {', '.join(missing)}")
  cfg = config_lib.base_config()
  for k in DIMS:
    cfg.model[k] = dims[k]
  cfg.model.value.preset = model_type
  cfg.model.dtype = cfg.model.param_dtype = "float32"
  return cfg


def _t(w):
  return np.asarray(w).T


def reference_names(model: model_lib.GPT) -> dict:
  """Our parameter path -> (reference key, function from reference array to ours)."""
  names = {
      ("wte",): ("transformer.wte.weight", np.asarray),
      ("lm_head",): ("lm_head.weight", _t),
      ("smear_w",): ("smear_gate.weight", lambda w: np.asarray(w).reshape(-1)),
      ("smear_lambda",): ("smear_lambda", lambda w: np.asarray(w).reshape(())),
  }
  for i, block in enumerate(model.blocks):
    a, h = block.attn, f"transformer.h.{i}"
    names[("blocks", str(i), "attn", "wq")] = (f"{h}.attn.c_q.weight", _t)
    names[("blocks", str(i), "attn", "wk")] = (f"{h}.attn.c_k.weight", _t)
    if a.wv is not None:
      names[("blocks", str(i), "attn", "wv")] = (f"{h}.attn.c_v.weight", _t)
    names[("blocks", str(i), "attn", "wo")] = (f"{h}.attn.c_proj.weight", _t)
    for c in a.coeffs:
      names[("blocks", str(i), "attn", "coeffs", c)] = (
          f"{h}.attn.{c}_v", lambda w: np.asarray(w).reshape(()))
    if a.gate is not None:
      names[("blocks", str(i), "attn", "gate")] = (f"{h}.attn.ve_gate.weight", _t)
    names[("blocks", str(i), "mlp", "w_fc")] = (f"{h}.mlp.c_fc.weight", _t)
    names[("blocks", str(i), "mlp", "w_proj")] = (f"{h}.mlp.c_proj.weight", _t)
  first = {}
  for layer, name in sorted(model.table_of.items()):
    first.setdefault(name, layer)
  for name, layer in first.items():
    names[("tables", name)] = (f"value_embeds.{layer}.weight", np.asarray)
  return names


def _clean_key(k: str) -> str:
  return k[len("_orig_mod."):] if k.startswith("_orig_mod.") else k


def load_state_dict(model: model_lib.GPT, state_dict: dict) -> list[str]:
  """Fills `model` in place; returns the reference keys it did not use."""
  sd = {_clean_key(k): v for k, v in state_dict.items()}
  names = reference_names(model)
  state = nnx.state(model)
  flat = dict(nnx.to_flat_state(state))
  used = set()
  for path, var in flat.items():
    spath = tuple(str(p) for p in path)
    if spath not in names:
      raise AssertionError(f"no reference name for parameter {spath}")
    key, fn = names[spath]
    if key not in sd:
      raise ConversionError(f"reference state_dict lacks {key!r} (needed for {'/'.join(spath)})")
    arr = fn(sd[key])
    if arr.shape != tuple(var.shape):
      want = tuple(reversed(var.shape)) if fn is _t else tuple(var.shape)
      raise ConversionError(
          f"reference tensor {key!r} has shape {tuple(np.shape(sd[key]))}; "
          f"expected {want} for this model")
    var.set_value(jnp.asarray(arr, dtype=var.dtype))
    used.add(key)
  nnx.update(model, state)
  return sorted(k for k in sd if k not in used)


def from_nanochat(state_dict: dict, model_type: str, **dims) -> model_lib.GPT:
  """A fp32 bov_jax model holding the reference's weights; model(tokens) -> logits [B,T,V]."""
  cfg = config_for(model_type, **dims)
  model = model_lib.GPT(spec_lib.model_of(cfg))
  dropped = load_state_dict(model, state_dict)
  if dropped:
    logging.info("from_nanochat: dropped unused reference tensors: %s", ", ".join(dropped))
  return model


def to_nanochat(model: model_lib.GPT) -> dict:
  """The inverse mapping: our parameters under the reference's names (numpy)."""
  out = {}
  flat = {tuple(str(p) for p in path): v
          for path, v in nnx.to_flat_state(nnx.state(model))}
  for path, (key, fn) in reference_names(model).items():
    arr = np.asarray(flat[path].get_value(), np.float32)
    if fn is _t:
      arr = arr.T
    elif key.endswith(("_v", "smear_lambda")):
      arr = arr.reshape(1)
    elif key == "smear_gate.weight":
      arr = arr.reshape(1, -1)
    out[key] = arr
  # The reference stores a shared table under every target layer's key.
  for layer, name in model.table_of.items():
    out[f"value_embeds.{layer}.weight"] = np.asarray(model.tables[name][...], np.float32)
  return out


# -- a reference checkpoint file as a run directory ------------------------------

def _read_meta(path: str) -> dict:
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConversionError(f"--meta={path}: cannot read a JSON object ({e})") from e
  cfg = meta.get("model_config", meta)
  return {"dims": {k: cfg[k] for k in DIMS if k in cfg},
          "model_type": (meta.get("model_type") or cfg.get("model_type")
                         or meta.get("user_config", {}).get("model_type"))}


def _load_torch(path: str) -> dict:
  torch = extras.require("torch", "torch", f"reading {path} (a PyTorch checkpoint)")
  sd = torch.load(path, map_location="cpu", weights_only=True)
  return {k: v.detach().float().numpy() for k, v in sd.items()}


def convert_file(checkpoint: str, meta: str, workdir: str, model_type: str | None = None,
                 step: int | None = None, tokenizer: str | None = None) -> str:
  info = _read_meta(meta)
  model_type = model_type or info["model_type"]
  if not model_type:
    raise ConversionError(f"--meta={meta} names no model_type; pass --model_type=NAME")
  if not os.path.exists(checkpoint):
    raise ConversionError(f"--checkpoint={checkpoint}: no such file")
  if checkpoint.endswith(".npz"):
    state_dict = dict(np.load(checkpoint))
  else:
    state_dict = _load_torch(checkpoint)
  model = from_nanochat(state_dict, model_type, **info["dims"])
  if step is None:
    m = re.search(r"(\d+)", os.path.basename(checkpoint))
    step = int(m.group(1)) if m else 0
  if tokenizer:
    tok = tok_lib.checked(tok_lib.load(tokenizer), f"--tokenizer={tokenizer}",
                          info["dims"]["vocab_size"])
    tok.save(rundir.tokenizer(workdir))
  return ckpt_lib.save_params(workdir, config_for(model_type, **info["dims"]),
                              nnx.to_pure_dict(nnx.state(model)), step)
