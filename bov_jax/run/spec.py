"""The run spec: the config checked and resolved once, at the boundary, into frozen values.

`resolve(cfg)` runs every check that needs only the config and the device count
(`check`), then resolves every `auto` for the backend the run is built for and derives
what the model, optimizer, data, step and loop would otherwise each recompute: the model
spec (settings/model_spec.py), the decode kernel decided for the target device, the
effective learning rates and weight decay, the batch layout. Nothing below reads the
mutable config or tests the backend for a setting of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import ml_collections

from bov_jax.kernels import attention
from bov_jax.kernels import bank_decode
from bov_jax.optim import optimizer as optim
from bov_jax.parallel import lookup
from bov_jax.parallel import sharding
from bov_jax.run import plan
from bov_jax.settings import config as config_lib
from bov_jax.settings import model_spec as model_spec_lib
from bov_jax.settings import values
from bov_jax.settings.model_spec import ModelSpec
from bov_jax.settings.model_spec import tristate


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  embedding_lr: float
  unembedding_lr: float
  matrix_lr: float
  scalar_lr: float
  weight_decay: float
  warmup_steps: int
  warmdown_ratio: float
  final_lr_frac: float
  muon_batched: bool
  polar_dtype: str
  polar_gram: bool
  update_dtype: str          # Muon's final update
  shard_optimizer: bool      # the update split over the mesh (step.py)
  # The effective learning rates and Muon's weight decay, the settings above scaled by
  # batch size and width (optim.hyperparams): {group: value}
  hyperparams: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RunSpec:
  model: ModelSpec
  sample_model: ModelSpec    # the model as --mode=sample runs it (sample.tables_on_host)
  optim: OptimSpec
  n_devices: int             # the devices the run is for: the mesh's size
  batch: plan.BatchLayout    # how a step's train.batch_tokens lie on them
  init_from: str             # an exported folder a new run's weights start from
  # Sections with nothing to resolve, frozen as they were written.
  train: ml_collections.FrozenConfigDict
  data: ml_collections.FrozenConfigDict
  eval: ml_collections.FrozenConfigDict
  sample: ml_collections.FrozenConfigDict
  log: ml_collections.FrozenConfigDict
  mesh: ml_collections.FrozenConfigDict
  config_json: str           # the config as written (config.json of the run directory)

  def config(self) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(json.loads(self.config_json))




def _optim(optim_cfg, backend: str, compute_dtype: str, hyperparams: dict) -> OptimSpec:
  return OptimSpec(
      embedding_lr=optim_cfg.embedding_lr, unembedding_lr=optim_cfg.unembedding_lr,
      matrix_lr=optim_cfg.matrix_lr, scalar_lr=optim_cfg.scalar_lr,
      weight_decay=optim_cfg.weight_decay, warmup_steps=optim_cfg.warmup_steps,
      warmdown_ratio=optim_cfg.warmdown_ratio, final_lr_frac=optim_cfg.final_lr_frac,
      # one matrix at a time measured faster on CPU; batched on accelerators
      muon_batched=tristate(optim_cfg.muon_batched, backend != "cpu"),
      # bfloat16 operands as in the reference (products accumulate in float32)
      polar_dtype="bfloat16" if optim_cfg.polar_dtype == "auto" else optim_cfg.polar_dtype,
      # the float32 Gram-space form has fewer FLOPs; accelerators run bf16 matmuls
      # several times faster than float32 ones, so there the direct iteration wins
      polar_gram=tristate(optim_cfg.polar_gram, backend == "cpu"),
      # the reference applies Muon's update in bfloat16 under bfloat16 compute
      update_dtype=(("bfloat16" if compute_dtype == "bfloat16" else "float32")
                    if optim_cfg.muon_update_dtype == "auto" else optim_cfg.muon_update_dtype),
      shard_optimizer=bool(optim_cfg.shard_optimizer), hyperparams=hyperparams)


def configured_devices(mesh_cfg, here: int | None = None) -> int:
  """The devices a run with these mesh settings is for: the fixed sizes as given, a -1
  taking what is here (`here`, default this process's devices; at least one)."""
  sizes = (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
  fixed = math.prod(s for s in sizes if s > 0)
  here = jax.device_count() if here is None else here
  return fixed * max(1, here // fixed) if -1 in sizes else fixed


def _check_model(cfg) -> None:
  """The checks of the settings alone: each setting's range and type (config.validate),
  the value mode (values.mode_from_config), the widths a mode reads."""
  config_lib.validate(cfg)
  m = cfg.model
  mode = values.mode_from_config(m.value, m.n_layer)
  if mode.combine == "gated_add" and m.n_embd < values.GATE_CHANNELS:
    raise config_lib.ConfigError(
        f"model.value.combine='gated_add' reads {values.GATE_CHANNELS} channels; "
        f"model.n_embd={m.n_embd} is smaller")
  if m.attention == "splash" and not attention.splash_fits(m.sequence_len):
    raise config_lib.ConfigError(
        "model.attention='splash' needs model.sequence_len to be a multiple of "
        f"{attention.SPLASH_BLOCK} (Splash's block rows); got {m.sequence_len}")


def check(cfg, n_devices: int, platform: str, device=None) -> None:
  """Every check that needs only the config and the device count, before anything is
  built or written: the settings alone (`_check_model`), then the mesh and the batch it
  lays out on `n_devices`, and where sampling may keep the tables. Raises ConfigError
  naming the setting."""
  _check_model(cfg)
  m = cfg.model
  sharding.mesh_sizes(cfg.mesh, n_devices)
  plan.batch_layout(m.sequence_len, cfg.train.batch_tokens, cfg.train.device_batch_size,
                    n_devices, n_devices)
  if cfg.sample.tables_on_host:
    if n_devices > 1:
      raise config_lib.ConfigError(
          "sample.tables_on_host=True is supported for a model on a single device; this "
          f"run's mesh spans {n_devices}")
    if device is not None and not lookup.host_memory_supported(device):
      raise config_lib.ConfigError(
          f"sample.tables_on_host=True is not supported on this backend ({platform}): "
          "its devices have no pinned_host memory")


def _ref_scaling_params(vocab_size: int) -> int:
  """D_ref: the dense d12 layout's scaling parameters with this run's vocabulary."""
  ref = config_lib.depth_config(12)
  ref.model.vocab_size = vocab_size
  return plan.scaling_params(model_spec_lib.model_spec(ref.model, "cpu"))


def _target(backend: str | None, device):
  """The backend built for (default: this process's) and a device of it to ask, if any."""
  backend = backend or jax.default_backend()
  if device is None and backend == jax.default_backend():
    device = jax.devices()[0]
  return backend, device


def _model(cfg, backend: str, device) -> ModelSpec:
  model = model_spec_lib.model_spec(cfg.model, backend)
  if model.decode_attention == "fused_if_compiles":  # decided here, once, for the target
    model = (bank_decode.resolve(model, device) if device is not None
             else dataclasses.replace(model, decode_attention="xla"))
  return model


def model_of(cfg, backend: str | None = None, device=None) -> ModelSpec:
  """The model spec alone, for what builds no run on devices (an export, a report, a
  conversion): the settings' own checks, none of the devices'."""
  backend, device = _target(backend, device)
  _check_model(cfg)
  return _model(cfg, backend, device)


def resolve(cfg, backend: str | None = None, n_devices: int | None = None,
            device=None) -> RunSpec:
  """The config checked and resolved for a run on `n_devices` devices (default: the
  mesh settings' count, -1 taking this process's devices) of `backend` (default: this
  process's). `device` is one target device, asked whether the fused decode kernel
  compiles there (default: this process's first, when it is of `backend`); a TPU spec
  resolved with no TPU device to ask decodes with `xla`."""
  backend, device = _target(backend, device)
  n_devices = configured_devices(cfg.mesh) if n_devices is None else n_devices
  check(cfg, n_devices, backend, device)
  model = _model(cfg, backend, device)
  t = cfg.train
  base = _optim(cfg.optim, backend, cfg.model.dtype, {})
  hp = optim.hyperparams(base, model.n_embd, t.batch_tokens, plan.scaling_params(model),
                         _ref_scaling_params(model.vocab_size))
  frozen = lambda name: ml_collections.FrozenConfigDict(cfg[name])
  return RunSpec(model=model,
                 sample_model=dataclasses.replace(model,
                                                  tables_on_host=bool(cfg.sample.tables_on_host)),
                 optim=dataclasses.replace(base, hyperparams=hp),
                 n_devices=n_devices,
                 batch=plan.batch_layout(model.sequence_len, t.batch_tokens,
                                         t.device_batch_size, n_devices,
                                         n_devices // jax.process_count()),
                 init_from=cfg.model.init_from,
                 train=frozen("train"), data=frozen("data"), eval=frozen("eval"),
                 sample=frozen("sample"), log=frozen("log"), mesh=frozen("mesh"),
                 config_json=cfg.to_json())
