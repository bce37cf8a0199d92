"""A run's weights as a Hugging Face style folder: safetensors, config.json, the run's
config, the tokenizer and a model card.

  python -m bov_jax.export --workdir=DIR --out=DIR2 [--step=N] [--dtype=D]
                           [--max_shard_gib=5]

The folder (names in rundir.py):
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
  README.md                    a model card: value mode, tokens trained, last metrics

Tensors are fetched and written one at a time, so a sharded run is never gathered whole
on one host.
"""

from __future__ import annotations

import json
import math
import struct
import sys

import numpy as np
from etils import epath

from bov_jax import cli
from bov_jax import rundir

# safetensors' dtype names; the library writes a file from a dict of whole arrays, so a
# tensor-at-a-time writer (no host holds every parameter) is written by hand here.
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32",
           "int64": "I64", "uint32": "U32", "bool": "BOOL"}


class ExportError(ValueError):
  pass


def tensor_names(params: dict, prefix: str = "") -> dict:
  """{dotted name: leaf} of a nested parameter dict (nnx's pure dict)."""
  out = {}
  for key, value in params.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(tensor_names(value, name + "."))
    else:
      out[name] = value
  return out


def _nest(flat: dict) -> dict:
  """The inverse of `tensor_names`; integer keys (layer indices) come back as ints."""
  out = {}
  for name, value in flat.items():
    node, parts = out, name.split(".")
    for part in parts[:-1]:
      node = node.setdefault(int(part) if part.isdigit() else part, {})
    node[int(parts[-1]) if parts[-1].isdigit() else parts[-1]] = value
  return out


def _shards(sizes: dict, limit: int) -> list[list[str]]:
  """Names grouped in order into files of at most `limit` bytes (a larger tensor alone)."""
  groups, current, used = [], [], 0
  for name, n in sizes.items():
    if current and used + n > limit:
      groups.append(current)
      current, used = [], 0
    current.append(name)
    used += n
  return groups + ([current] if current else [])


def _write_file(path: epath.Path, names: list[str], shapes: dict, dtypes: dict, sizes: dict,
                fetch) -> None:
  """One safetensors file: an 8-byte header length, the JSON header (dtype, shape, byte
  offsets per tensor), then each tensor's bytes in order, fetched one at a time."""
  header, offset = {}, 0
  for name in names:
    header[name] = {"dtype": _DTYPES[dtypes[name]], "shape": list(shapes[name]),
                    "data_offsets": [offset, offset + sizes[name]]}
    offset += sizes[name]
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with path.open("wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for name in names:
      array = np.ascontiguousarray(fetch(name), dtype=np.dtype(dtypes[name]))
      f.write(array.tobytes())


def write_weights(out: str, params: dict, dtype: str | None = None,
                  max_shard_bytes: int = 5 * 2**30, fetch=None) -> list[str]:
  """The safetensors file(s) of `params` under `out`; the files written. `fetch(name)`
  gives a tensor's host array (default: np.asarray of the leaf)."""
  import ml_dtypes  # registers bfloat16 with numpy
  del ml_dtypes
  leaves = tensor_names(params)
  shapes = {k: tuple(v.shape) for k, v in leaves.items()}
  dtypes = {}
  for k, v in leaves.items():
    stored = str(np.dtype(v.dtype))
    floating = np.issubdtype(np.dtype(v.dtype), np.floating) or stored == "bfloat16"
    dtypes[k] = dtype if dtype and floating else stored
    if dtypes[k] not in _DTYPES:
      raise ExportError(f"{k}: dtype {dtypes[k]} has no safetensors name (--dtype: "
                        f"{', '.join(d for d in _DTYPES if d.startswith(('float', 'bf')))})")
  fetch = fetch or (lambda name: np.asarray(leaves[name]))
  sizes = {k: math.prod(shapes[k]) * np.dtype(dtypes[k]).itemsize for k in leaves}
  groups = _shards(sizes, max_shard_bytes)
  root = epath.Path(out)
  root.mkdir(parents=True, exist_ok=True)
  if len(groups) == 1:
    files = [rundir.EXPORT_WEIGHTS]
  else:
    files = [rundir.EXPORT_SHARD.format(i + 1, len(groups)) for i in range(len(groups))]
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {n: f for f, g in zip(files, groups) for n in g}}
    (root / rundir.EXPORT_INDEX).write_text(json.dumps(index, indent=2))
  for f, g in zip(files, groups):
    _write_file(root / f, g, shapes, dtypes, sizes, fetch)
  return [str(root / f) for f in files]


def _read_file(path: epath.Path) -> dict:
  import ml_dtypes
  by_name = {v: k for k, v in _DTYPES.items()}
  data = path.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8:8 + n])
  out = {}
  for name, h in header.items():
    if name == "__metadata__":
      continue
    a, b = h["data_offsets"]
    dt = ml_dtypes.bfloat16 if h["dtype"] == "BF16" else np.dtype(by_name[h["dtype"]])
    out[name] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=dt).reshape(h["shape"])
  return out


def read_weights(folder: str) -> dict:
  """The parameters of an exported folder as the model's nested dict of numpy arrays."""
  root = epath.Path(folder)
  if (root / rundir.EXPORT_INDEX).exists():
    files = sorted(set(json.loads((root / rundir.EXPORT_INDEX).read_text())["weight_map"]
                       .values()))
  elif (root / rundir.EXPORT_WEIGHTS).exists():
    files = [rundir.EXPORT_WEIGHTS]
  else:
    raise ExportError(f"{folder} holds no {rundir.EXPORT_WEIGHTS} or {rundir.EXPORT_INDEX}")
  flat = {}
  for f in files:
    flat.update(_read_file(root / f))
  return _nest(flat)


def hf_config(spec, dtype: str, step: int) -> dict:
  """config.json in the Hugging Face style, from the resolved model spec."""
  m, mode = spec.model, spec.model.value
  return {"architectures": ["BovGPTForCausalLM"], "model_type": "bov_gpt",
          "hidden_size": m.n_embd, "num_hidden_layers": m.n_layer,
          "num_attention_heads": m.n_head, "num_key_value_heads": m.n_kv_head,
          "head_dim": m.head_dim, "vocab_size": m.vocab_size,
          "max_position_embeddings": m.sequence_len, "window_sizes": list(m.windows),
          "value_mode": {"preset": mode.preset, "source": mode.source,
                         "combine": mode.combine, "coeff": mode.coeff,
                         "layers": mode.layers, "shared_table": mode.shared_table},
          "value_layers": list(m.target_layers), "torch_dtype": dtype, "step": step,
          "bov_jax_version": _version()}


def _version() -> str:
  from importlib import metadata
  try:
    return metadata.version("bov_jax")
  except metadata.PackageNotFoundError:
    return "unknown"


def model_card(spec, metrics: list[dict], step: int) -> str:
  """README.md: what the model is and how it did, from the run's metrics (the Hub reads
  the front matter's library name and tags)."""
  mode = spec.model.value
  last = metrics[-1] if metrics else {}
  bpb = next((r["val_bpb"] for r in reversed(metrics) if "val_bpb" in r), None)
  core = next((r["core"] for r in reversed(metrics) if "core" in r), None)
  lines = ["---", "library_name: bov_jax", "tags: [bov_jax, bank-of-values]", "---", "",
           f"# bov_jax model: {mode.preset or 'custom value mode'}", "",
           "A GPT-style language model trained with bov_jax (Bank of Values), "
           f"{spec.model.n_layer} layers, width {spec.model.n_embd}, vocabulary "
           f"{spec.model.vocab_size}, context {spec.model.sequence_len}.", "",
           f"- value mode: source {mode.source}, combine {mode.combine}, coefficient "
           f"{mode.coeff}, layers {list(spec.model.target_layers)}",
           f"- checkpoint step: {step}; tokens trained: {last.get('tokens', 'unknown')}",
           f"- final validation bits per byte: {bpb if bpb is not None else 'not measured'}",
           f"- CORE: {core if core is not None else 'not measured'}", "",
           "Files: `model.safetensors` (or its shards and index), `config.json`, "
           "`run_config.json` (the run's whole config), `tokenizer.json` (the `tokenizers` "
           "library's format) and `tokenizer.pkl` (the authors' tiktoken file). "
           "Tensor names: bov_jax's docs/design.md.", ""]
  return "\n".join(lines)


def export(workdir: str, out: str, step: int | None = None, dtype: str | None = None,
           max_shard_bytes: int = 5 * 2**30) -> dict:
  """Writes the folder; returns {"out", "step", "files"}: every file written, the weights'
  first."""
  import jax
  from flax import nnx

  from bov_jax import checkpoint
  from bov_jax import model as model_lib
  from bov_jax import spec as spec_lib
  from bov_jax import tokenizer as tok_lib
  cfg = rundir.config_of(workdir)
  spec = spec_lib.resolve(cfg)
  abstract = nnx.to_pure_dict(nnx.state(model_lib.abstract(spec.model)))
  restored = checkpoint.Checkpoints(workdir, async_save=False).restore(abstract, only=step)
  if restored is None:
    raise ExportError(f"no checkpoint under {rundir.checkpoints(workdir)}")
  leaves = tensor_names(restored.params)

  def fetch(name):  # one tensor on the host at a time (all processes join each gather)
    from jax.experimental import multihost_utils
    x = leaves[name]
    return np.asarray(multihost_utils.process_allgather(x, tiled=True)
                      if jax.process_count() > 1 else x)

  files = write_weights(out, restored.params, dtype, max_shard_bytes, fetch)
  root = epath.Path(out)
  stored = str(np.dtype(leaves["lm_head"].dtype))
  hf = hf_config(spec, dtype or stored, int(restored.step))
  (root / rundir.EXPORT_CONFIG).write_text(json.dumps(hf, indent=2))
  (root / rundir.RUN_CONFIG).write_text(cfg.to_json(indent=2))
  tok = tok_lib.load(rundir.tokenizer(workdir))
  tok.save(str(root))
  (root / rundir.EXPORT_TOKENIZER).write_text(json.dumps(tok_lib.hf_json(tok)))
  records = rundir.read_metrics(workdir) or []
  (root / rundir.MODEL_CARD).write_text(model_card(spec, records, restored.step))
  written = [str(root / n) for n in (rundir.EXPORT_CONFIG, rundir.RUN_CONFIG, tok_lib.PICKLE,
                                     tok_lib.TOKEN_BYTES, rundir.EXPORT_TOKENIZER,
                                     rundir.MODEL_CARD)]
  return {"out": str(root), "step": int(restored.step), "files": files + written}


def main(argv) -> int:
  from absl import app
  from absl import flags
  f = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not f.workdir or not f.out:
    raise app.UsageError("--workdir=DIR and --out=DIR2 are required")
  try:
    result = export(f.workdir, f.out, f.step, f.dtype, int(f.max_shard_gib * 2**30))
  except (ExportError, ValueError, OSError) as e:  # bad input (2), or the environment failed (1)
    return cli.failed(e)
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  from absl import flags
  flags.DEFINE_string("workdir", None, "the run directory to export")
  flags.DEFINE_string("out", None, "the folder to write (local or gs://)")
  flags.DEFINE_integer("step", None, "the checkpoint step (default: the newest that reads)")
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                    "cast floating tensors to this dtype (default: as the run stores them)")
  flags.DEFINE_float("max_shard_gib", 5.0, "above this, the weights are split into files")
  cli.run(lambda argv: sys.exit(main(argv)))
