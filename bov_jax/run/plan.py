"""What a run costs before anything runs: parameters, FLOPs, the step budget, memory.

Counts come from the real model's parameter shapes under `nnx.eval_shape` (no
allocation), so the plan can never disagree with what `model/gpt.py` builds. FLOPs
follow the reference's estimate_flops:

  flops_per_token = 6 * N_matmul + sum_i 12 * H * dh * min(w_i, T)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from bov_jax.model import gpt as model_lib
from bov_jax.optim import optimizer as optim
from bov_jax.parallel import sharding
from bov_jax.parallel import state_layout
from bov_jax.settings import config as config_lib
from bov_jax.settings import values
from bov_jax.settings.model_spec import ModelSpec


@functools.lru_cache(maxsize=8)  # an eval_shape of the whole model: once per model, not per figure
def _flat(model_spec):
  state = nnx.state(model_lib.abstract(model_spec))
  return {tuple(str(p) for p in path): v for path, v in nnx.to_flat_state(state)}


def param_counts(m: ModelSpec) -> dict:
  """params (all), params_dense (without value tables) and N_matmul."""
  size = {path: int(np.prod(v.shape)) for path, v in _flat(m).items()}
  total = sum(size.values())
  tables = sum(n for path, n in size.items() if path[0] == "tables")
  layers = m.layers
  matmul = 0
  for path, n in size.items():
    if path[0] == "lm_head":
      matmul += n
    elif path[0] == "blocks":
      layer, name = int(path[1]), path[-1]
      if name == "wv":  # a value matrix counts once per matmul that reaches the loss
        matmul += n * layers[layer].value_matmuls
      elif "coeffs" not in path:
        matmul += n
  return {"params": total, "params_dense": total - tables, "n_matmul": matmul}


def attention_flops(m: ModelSpec) -> int:
  return sum(12 * m.n_head * m.head_dim * min(w, m.sequence_len) for w in m.windows)


def flops_per_token(m: ModelSpec) -> int:
  return 6 * param_counts(m)["n_matmul"] + attention_flops(m)


def scaling_params(m: ModelSpec) -> int:
  """D: parameters in the transformer blocks plus W_lm on the dense baseline layout."""
  baseline = dataclasses.replace(m, value=values.ValueMode(preset="gpt_base"))
  return sum(int(np.prod(v.shape)) for path, v in _flat(baseline).items()
             if path[0] in ("blocks", "lm_head"))


def num_iterations(spec, fpt: int | None = None) -> int:
  t = spec.train
  if t.num_iterations > 0:
    return int(t.num_iterations)
  fpt = flops_per_token(spec.model) if fpt is None else fpt
  return int(round(t.target_flops / (fpt * t.batch_tokens)))


class _MeshSizes:
  """Just the axis sizes of a mesh: enough for the sharding rules, no devices needed."""

  def __init__(self, sizes: dict):
    self.shape = sizes


def _layout(spec):
  """(mesh sizes, abstract parameters, their specs, the specs the optimizer keeps them
  in): the real sharding rules on abstract shapes, nothing allocated."""
  mesh = _MeshSizes(sharding.mesh_sizes(spec.mesh, spec.n_devices))
  abstract = nnx.state(model_lib.abstract(spec.model))
  specs = sharding.param_specs(abstract, mesh)
  params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                        nnx.to_pure_dict(abstract))
  kept = (state_layout.update_specs(specs, params, mesh, optim.splits_across_slices)
          if spec.optim.shard_optimizer else specs)
  return mesh, params, specs, kept


def memory_per_device(spec, num_iterations: int = 100) -> dict:
  """Parameter and optimizer-state bytes one device holds under the configured mesh,
  from the real sharding rules applied to abstract shapes (nothing is allocated); the
  optimizer state split over data replicas too where optim.shard_optimizer says so."""
  mesh, params, specs, kept = _layout(spec)
  opt, opt_specs = state_layout.optimizer_specs(optim.make(spec.optim, num_iterations),
                                            params, kept)
  return {"mesh": dict(mesh.shape),
          "param_bytes_per_device": state_layout.bytes_per_device(params, specs, mesh.shape),
          "optimizer_bytes_per_device": state_layout.bytes_per_device(opt, opt_specs, mesh.shape)}


def _shares(spec) -> tuple[dict, int, int, int]:
  """(mesh sizes, the bytes of one chip's share of the gradients once reduced inside its
  slice, and of that the part split across slices too (Muon's matrices,
  `optim.splits_across_slices`): its bytes and its elements)."""
  mesh, params, _, kept = _layout(spec)
  in_slice = {**mesh.shape, "slice": 1}
  share = state_layout.bytes_per_device(params, kept, in_slice)
  pairs = [(x, s) for x, s in zip(jax.tree.leaves(params),
                                  jax.tree.leaves(kept, is_leaf=lambda x: isinstance(x, P)))
           if state_layout.slice_split(s)]
  split = state_layout.bytes_per_device([x for x, _ in pairs], [s for _, s in pairs], in_slice)
  elements = sum(state_layout.bytes_per_device([x], [s], in_slice) // x.dtype.itemsize
                 for x, s in pairs)
  return mesh.shape, share, split, elements


def gradient_share_bytes(spec) -> int:
  """The bytes of one chip's share of a step's gradients once they are reduced inside its
  slice (stored dtypes; the optimizer's share where optim.shard_optimizer splits it): the
  floor of what crosses slices is this share all-reduced once."""
  return _shares(spec)[1]


DCN_GBPS = 25.0  # a v5e host's data-center network, 2 x 100 Gbit/s, over its 8 chips


def across_slices(spec, peak_flops: float | None = None, dcn_gbps: float = DCN_GBPS) -> dict:
  """What a step sends between slices and how long that takes at `dcn_gbps` Gbit/s a
  chip, beside the step's compute at the chip's peak (the least it takes). The floor:
  each chip's gradient share all-reduced across the S slices (a ring sends 2 (S-1)/S of
  it). What the step sends (training/step.py, optim.muon): Adam's part of the share
  all-reduced so; Muon's reduce-scattered ((S-1)/S of it), its momentum's rows sent to
  the matrices' owners ((S-1)/S of a 1/S share, float32) and the updates gathered back
  ((S-1)/S of the share in optim.muon_update_dtype)."""
  sizes, share, split, elements = _shares(spec)
  s = sizes["slice"]
  floor = 2 * (s - 1) / s * share
  update = np.dtype(spec.optim.update_dtype).itemsize
  sent = (2 * (s - 1) / s * (share - split)
          + (s - 1) / s * (split + 4 * elements / s + update * elements))
  out = {"slices": s, "gradient_share_bytes": share, "floor_bytes_per_chip": int(floor),
         "sent_bytes_per_chip": int(sent), "sent_vs_floor": round(sent / floor, 3),
         "dcn_gbps_per_chip": dcn_gbps, "dcn_seconds": sent * 8 / (dcn_gbps * 1e9)}
  if peak_flops:
    flops = flops_per_token(spec.model) * spec.train.batch_tokens / spec.n_devices
    out["compute_seconds_at_peak"] = flops / peak_flops
    out["dcn_vs_compute"] = round(out["dcn_seconds"] / out["compute_seconds_at_peak"], 4)
  return out


PRECISION_GROUPS = {"embed": "embedding", "table": "tables", "muon": "matrices",
                    "unembed": "lm_head", "smear": "scalars", "alpha": "scalars",
                    "beta_gamma": "scalars"}


def param_dtypes(m: ModelSpec) -> dict:
  """The stored dtype of each parameter group (optimizer moments follow it)."""
  out = {}
  for path, v in _flat(m).items():
    out.setdefault(PRECISION_GROUPS[optim.label(path)], str(np.dtype(v.dtype)))
  return out


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How one optimizer step's train.batch_tokens are laid out."""
  rows_per_device: int  # per micro-batch
  accum: int            # micro-batches per step
  local_rows: int       # rows per micro-batch that this process loads


def batch_layout(sequence_len: int, batch_tokens: int, device_batch_size: int, n_devices: int,
                 n_local: int) -> BatchLayout:
  """Rows per device per micro-batch: train.device_batch_size, or fewer when one step's
  batch is smaller than that many rows on every device; then as many micro-batches as
  reach train.batch_tokens. Raises ConfigError for a batch the devices cannot share."""
  T, tokens, n_dev = sequence_len, batch_tokens, n_devices
  rows_total = tokens // T
  if tokens % T or rows_total % n_dev:
    raise config_lib.ConfigError(
        f"train.batch_tokens={tokens} must be a multiple of "
        f"model.sequence_len x devices = {T} x {n_dev} = {T * n_dev}")
  per_device = min(device_batch_size, rows_total // n_dev)
  if (rows_total // n_dev) % per_device:
    raise config_lib.ConfigError(
        f"train.batch_tokens={tokens} must be a multiple of "
        f"train.device_batch_size x devices x model.sequence_len = "
        f"{per_device} x {n_dev} x {T} = {per_device * n_dev * T}")
  return BatchLayout(rows_per_device=per_device, accum=rows_total // (per_device * n_dev),
                     local_rows=per_device * n_local)


def make_plan(spec, peak_flops: float | None = None, dcn_gbps: float = DCN_GBPS) -> dict:
  """--mode=plan's figures for the run spec (on its configured devices); over several
  slices, what crosses them (`across_slices`; `peak_flops`: a chip's, where known)."""
  m = spec.model
  mode = m.value
  counts = param_counts(m)
  fpt = flops_per_token(m)
  iters = num_iterations(spec, fpt)
  tokens_per_step = int(spec.train.batch_tokens)
  return {
      "preset": mode.preset,
      "source": mode.source,
      "combine": mode.combine,
      "coeff": mode.coeff,
      "layers": mode.layers,
      "shared_table": mode.shared_table,
      "target_layers": m.target_layers,
      "params": counts["params"],
      "params_dense": counts["params_dense"],
      "n_matmul": counts["n_matmul"],
      "flops_per_token": fpt,
      "tokens_per_step": tokens_per_step,
      "num_iterations": iters,
      "total_tokens": iters * tokens_per_step,
      "total_flops": float(fpt) * iters * tokens_per_step,
      "windows": list(m.windows),
      "eval_tokens": int(spec.train.eval_tokens),
      "param_dtypes": param_dtypes(m),
      "muon_update_dtype": spec.optim.update_dtype,
      **memory_per_device(spec, iters),
      **({"across_slices": across_slices(spec, peak_flops, dcn_gbps)}
         if spec.mesh.slices > 1 else {}),
  }
