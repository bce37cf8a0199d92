"""What a config costs before anything runs: parameters, FLOPs, the step budget.

Counts come from the real model's parameter shapes under `nnx.eval_shape` (no
allocation), so the plan can never disagree with what `model.py` builds.
FLOPs follow SPEC section 3 (nanochat's estimate_flops):

  flops_per_token = 6 * N_matmul + sum_i 12 * H * dh * min(w_i, T)
"""

from __future__ import annotations


import jax
import numpy as np
from flax import nnx

from bov_jax import config as config_lib
from bov_jax import model as model_lib
from bov_jax import values


def abstract_state(cfg):
  return nnx.state(nnx.eval_shape(lambda: model_lib.build(cfg)))


def _flat(state):
  return {tuple(str(p) for p in path): v for path, v in nnx.to_flat_state(state)}


def param_counts(cfg) -> dict:
  """params (all), params_dense (without value tables) and N_matmul."""
  flat = _flat(abstract_state(cfg))
  size = {path: int(np.prod(v.shape)) for path, v in flat.items()}
  total = sum(size.values())
  tables = sum(n for path, n in size.items() if path[0] == "tables")
  plan = values.layer_plan(config_lib.value_mode(cfg), cfg.model.n_layer)
  matmul = 0
  for path, n in size.items():
    if path[0] == "lm_head":
      matmul += n
    elif path[0] == "blocks":
      layer, name = int(path[1]), path[-1]
      if name == "wv":  # a value matrix counts once per matmul that reaches the loss
        matmul += n * plan[layer].value_matmuls
      elif "coeffs" not in path:
        matmul += n
  return {"params": total, "params_dense": total - tables, "n_matmul": matmul}


def attention_flops(cfg) -> int:
  m = cfg.model
  dh = m.n_embd // m.n_head
  T = m.sequence_len
  return sum(12 * m.n_head * dh * min(w, T) for w in config_lib.window_sizes(cfg))


def flops_per_token(cfg) -> int:
  return 6 * param_counts(cfg)["n_matmul"] + attention_flops(cfg)


def scaling_params(cfg) -> int:
  """D: parameters in the transformer blocks plus W_lm on the dense baseline layout."""
  baseline = cfg.copy_and_resolve_references()
  baseline.model.value.preset = "gpt_base"
  for k in ("source", "combine", "coeff", "layers", "shared_table"):
    baseline.model.value[k] = None
  flat = _flat(abstract_state(baseline))
  return sum(int(np.prod(v.shape)) for path, v in flat.items()
             if path[0] in ("blocks", "lm_head"))


def hyperparams(cfg) -> dict:
  """Effective LRs and Muon weight decay (SPEC section 4): D_ref is the dense d12 layout
  with this run's vocabulary."""
  from bov_jax import optim
  ref = config_lib.depth_config(12)
  ref.model.vocab_size = cfg.model.vocab_size
  return optim.hyperparams(cfg, scaling_params(cfg), scaling_params(ref))


def num_iterations(cfg, fpt: int | None = None) -> int:
  if cfg.train.num_iterations > 0:
    return int(cfg.train.num_iterations)
  fpt = flops_per_token(cfg) if fpt is None else fpt
  return int(round(cfg.train.target_flops / (fpt * cfg.train.batch_tokens)))


class _MeshSizes:
  """Just the axis sizes of a mesh: enough for the sharding rules, no devices needed."""

  def __init__(self, sizes):
    from bov_jax import sharding
    self.shape = dict(zip(sharding.MESH_AXES, sizes))


def memory_per_device(cfg, num_iterations: int = 100) -> dict:
  """Parameter and optimizer-state bytes one device holds under the configured mesh,
  from the real sharding rules applied to abstract shapes (nothing is allocated)."""
  import math as _m
  from bov_jax import optim
  from bov_jax import sharding
  sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  fixed = _m.prod(s for s in sizes if s > 0)
  # The plan is for the configured mesh, not for this host's devices: -1 takes what
  # is here (at least 1), fixed sizes are taken as given.
  n_dev = fixed * max(1, jax.device_count() // fixed) if -1 in sizes else fixed
  sizes = sharding.mesh_shape(cfg, n_dev)
  mesh = _MeshSizes(sizes)
  abstract = abstract_state(cfg)
  specs = sharding.param_specs(abstract, mesh)
  params = nnx.to_pure_dict(abstract)
  params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), params)
  hp = {k: 1e-3 for k in list(optim.ADAM_GROUPS) + ["muon", "muon_weight_decay"]}
  tx = optim.make(cfg, num_iterations, hp)
  opt = jax.eval_shape(tx.init, params)
  opt_specs = sharding.like_params(opt, specs, params)
  return {"mesh": dict(mesh.shape),
          "param_bytes_per_device": sharding.bytes_per_device(params, specs, mesh.shape),
          "optimizer_bytes_per_device": sharding.bytes_per_device(opt, opt_specs, mesh.shape)}


def make_plan(cfg) -> dict:
  mode = config_lib.validate(cfg)
  counts = param_counts(cfg)
  fpt = flops_per_token(cfg)
  iters = num_iterations(cfg, fpt)
  tokens_per_step = int(cfg.train.batch_tokens)
  return {
      "preset": mode.preset,
      "source": mode.source,
      "combine": mode.combine,
      "coeff": mode.coeff,
      "layers": mode.layers,
      "shared_table": mode.shared_table,
      "target_layers": values.target_layers(mode, cfg.model.n_layer),
      "params": counts["params"],
      "params_dense": counts["params_dense"],
      "n_matmul": counts["n_matmul"],
      "flops_per_token": fpt,
      "tokens_per_step": tokens_per_step,
      "num_iterations": iters,
      "total_tokens": iters * tokens_per_step,
      "total_flops": float(fpt) * iters * tokens_per_step,
      "windows": config_lib.window_sizes(cfg),
      **memory_per_device(cfg, iters),
  }


# Dense bf16 datasheet peaks, FLOP/s per chip.
DATASHEET_PEAK = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
}


def measured_cpu_peak(n: int = 1024, repeats: int = 5, seconds: float = 0.5) -> float:
  """The best of large fp32 matmuls on this host, FLOP/s: at least `repeats` of them
  and for at least `seconds` (on a shared host five alone once read half the peak)."""
  import time
  import jax.numpy as jnp
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(a).block_until_ready()
  best, start, k = 0.0, time.perf_counter(), 0
  while k < repeats or time.perf_counter() - start < seconds:
    t = time.perf_counter()
    f(a).block_until_ready()
    best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    k += 1
  return best


_PEAK_CACHE = {}


def peak_flops(device=None) -> float:
  """Peak FLOP/s of one device: datasheet on TPU/GPU, measured on CPU."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "")
  if device.platform == "cpu":
    if "cpu" not in _PEAK_CACHE:
      _PEAK_CACHE["cpu"] = measured_cpu_peak()
    return _PEAK_CACHE["cpu"]
  for name, value in DATASHEET_PEAK.items():
    if name.lower() in kind.lower():
      return value
  return float("nan")
