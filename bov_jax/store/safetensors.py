"""Parameters as safetensors files (an exported folder's weights, rundir.py's names):
written one tensor at a time, read back as the model's nested dict of numpy arrays."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from etils import epath

from bov_jax.store import rundir

# safetensors' dtype names; the library writes a file from a dict of whole arrays, so a
# tensor-at-a-time writer (no host holds every parameter) is written by hand here.
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32",
           "int64": "I64", "uint32": "U32", "bool": "BOOL"}


class WeightsError(ValueError):
  """Weights that cannot be written or read as asked (a dtype, a missing file)."""


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
  header, offset = {"__metadata__": {"format": "pt"}}, 0  # transformers reads only "pt" files
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
      raise WeightsError(f"{k}: dtype {dtypes[k]} has no safetensors name (--dtype: "
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
    raise WeightsError(f"{folder} holds no {rundir.EXPORT_WEIGHTS} or {rundir.EXPORT_INDEX}")
  flat = {}
  for f in files:
    flat.update(_read_file(root / f))
  return _nest(flat)
