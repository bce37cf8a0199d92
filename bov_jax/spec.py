"""The run spec: the config checked and resolved once, at the boundary, into frozen values.

`resolve(cfg)` validates every setting (config.validate, values.mode_from_config),
resolves every `auto` for the backend this process runs on, and derives what several
modules would otherwise each recompute (the value mode, per-layer windows, the head
dim). The model, optimizer, data, step, loop and inference receive these values and
never read the mutable config or test the backend for a setting of their own.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import ml_collections

from bov_jax import config as config_lib
from bov_jax import values


@dataclasses.dataclass(frozen=True)
class Stage:
  """Layers start + r * period + j (r < repeats, j < period): a block of `period` layers
  repeated `repeats` times, every repeat alike (each layer j's value role and window),
  so one compiled block runs them all under a `lax.scan`. A layer alone: period 1,
  repeats 1."""
  start: int
  period: int
  repeats: int

  def layers(self, j: int) -> list[int]:
    """The layers at position j of the block, one per repeat."""
    return [self.start + r * self.period + j for r in range(self.repeats)]

  @property
  def scanned(self) -> bool:
    return self.repeats > 1


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Everything that decides what the model computes and how (hashable: it keys jit)."""
  n_layer: int
  n_embd: int
  n_head: int
  n_kv_head: int
  sequence_len: int
  vocab_size: int
  windows: tuple[int, ...]   # per layer: query i sees key j iff 0 <= i - j <= w
  value: values.ValueMode
  dtype: str                 # compute
  param_dtype: str           # master weights
  embedding_dtype: str       # the token embedding and the value tables
  attention: str             # xla | cudnn | blocks | splash
  decode_attention: str      # xla | fused | fused_if_compiles
  table_lookup: str          # shard_map | gather | one_hot
  remat: str                 # a config.REMAT_POLICIES key
  loss_chunk: int
  scan: bool                 # repeated runs of layers scanned (`stages`), not unrolled
  # The target the program is built for, and the kernel forms chosen for it (the
  # kernels never ask the process's backend: a CPU host builds a TPU's program).
  platform: str              # cpu | gpu | tpu
  attention_block: int       # Splash attention's block rows (a divisor of the length is taken)
  matmul: str                # plain | cpu: kernels/matmul.py's CPU form of the backward
  sampler: str               # jax | cpu: kernels/sampling.py's hand-written CPU forms
  # Where the value tables live: host memory for sampling with sample.tables_on_host
  # (inference.tables_to_host sets it); rows are then gathered there.
  tables_on_host: bool = False
  init_from: str = ""        # an exported folder a new run's weights start from

  @property
  def splash_interpret(self) -> bool:
    """Splash is a TPU kernel: anywhere else it runs in the Pallas interpreter."""
    return self.platform != "tpu"

  @property
  def decode_kernel(self) -> str:
    """The fused bank-decode kernel's form: Triton on GPU, Mosaic otherwise."""
    return "gpu" if self.platform == "gpu" else "tpu"

  @property
  def decode_interpret(self) -> bool:
    return self.platform != self.decode_kernel

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def padded_vocab(self) -> int:
    return values.padded_vocab(self.vocab_size)

  @property
  def layers(self) -> tuple[values.LayerValue, ...]:
    return tuple(values.layer_plan(self.value, self.n_layer))

  @property
  def target_layers(self) -> list[int]:
    return values.target_layers(self.value, self.n_layer)

  @property
  def stages(self) -> tuple[Stage, ...]:
    return layer_stages(self)

  def describe(self) -> str:
    return (f"{self.n_layer}L d{self.n_embd} H{self.n_head}/{self.n_kv_head} "
            f"T{self.sequence_len} V{self.vocab_size} {self.value.describe()}")


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


@dataclasses.dataclass(frozen=True)
class RunSpec:
  model: ModelSpec
  optim: OptimSpec
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


MAX_PERIOD = 8  # the longest block of layers looked for (window patterns are short)


def _segment(kinds: list, period: int) -> list[Stage]:
  """Stages of one block length, greedily from the first layer: a block that repeats
  at least twice is a stage, any other layer stands alone."""
  out, i, L = [], 0, len(kinds)
  while i < L:
    r = 1
    while i + (r + 1) * period <= L and (kinds[i + r * period:i + (r + 1) * period]
                                          == kinds[i:i + period]):
      r += 1
    if r > 1:
      out.append(Stage(i, period, r))
      i += r * period
    else:
      out.append(Stage(i, 1, 1))
      i += 1
  return out


def layer_stages(m: ModelSpec) -> tuple[Stage, ...]:
  """The layers as stages: with `scan`, the block length that leaves the fewest layer
  bodies to compile (what compile time grows with), else every layer alone. Layers
  alike are those of one value role and window; layer 0 of a V1 mode, whose values
  later layers read, stands alone."""
  if not m.scan:
    return tuple(Stage(i, 1, 1) for i in range(m.n_layer))
  kinds = [(lv, w, i == 0 and m.value.source == "v1")
           for i, (lv, w) in enumerate(zip(m.layers, m.windows))]
  best = None
  for p in range(1, MAX_PERIOD + 1):
    stages = _segment(kinds, p)
    bodies = sum(st.period for st in stages)
    if best is None or bodies < best[0]:
      best = (bodies, stages)
  return tuple(best[1])


def short_window(m) -> int:
  """The `S` window: model.short_window, or the reference's ceil((T // 4) / 128) * 128."""
  if m.short_window > 0:
    return m.short_window
  return int(math.ceil((m.sequence_len // 4) / 128) * 128)


def window_sizes(m) -> tuple[int, ...]:
  """The pattern (e.g. SSSL) tiled over the layers; the last layer always sees everything."""
  pattern = m.window_pattern.upper()
  sizes = {"L": m.sequence_len, "S": short_window(m)}
  ws = [sizes[pattern[i % len(pattern)]] for i in range(m.n_layer)]
  ws[-1] = m.sequence_len
  return tuple(ws)


def _model(m, backend: str) -> ModelSpec:
  mode = values.mode_from_config(m.value, m.n_layer)
  if mode.combine == "gated_add" and m.n_embd < values.GATE_CHANNELS:
    raise config_lib.ConfigError(
        f"model.value.combine='gated_add' reads {values.GATE_CHANNELS} channels; "
        f"model.n_embd={m.n_embd} is smaller")
  attention = m.attention
  if attention == "auto":
    attention = {"tpu": "splash", "cpu": "blocks", "gpu": "cudnn"}.get(backend, "xla")
  if attention == "cudnn" and not (backend == "gpu" and m.dtype in ("bfloat16", "float16")
                                   and (m.n_embd // m.n_head) % 8 == 0
                                   and m.n_embd // m.n_head <= 128):
    attention = "xla"  # what cuDNN's flash attention takes: a GPU, half precision, dh <= 128
  decode = m.decode_attention
  if decode == "auto":  # the TPU kernel, where it compiles (kernels/bank_decode.py)
    decode = "fused_if_compiles" if backend == "tpu" else "xla"
  return ModelSpec(
      n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, n_kv_head=m.n_kv_head,
      sequence_len=m.sequence_len, vocab_size=m.vocab_size, windows=window_sizes(m),
      value=mode, dtype=m.dtype, param_dtype=m.param_dtype,
      # the reference stores these in bfloat16 under bfloat16 compute (docs/design.md)
      embedding_dtype=(("bfloat16" if m.dtype == "bfloat16" else m.param_dtype)
                       if m.embedding_dtype == "auto" else m.embedding_dtype),
      attention=attention,
      decode_attention=decode,
      table_lookup="shard_map" if m.table_lookup == "auto" else m.table_lookup,
      remat=m.remat,
      # XLA's CPU backend runs the unrolled step faster and compiles it in less time
      scan=_tristate(m.scan, backend != "cpu"),
      # cache-sized chunks on CPU; large ones keep an accelerator's matmuls full
      loss_chunk=m.loss_chunk or (256 if backend == "cpu" else 2048),
      platform=backend,
      attention_block=m.attention_block or 512,
      # XLA's CPU backend: see kernels/matmul.py and kernels/sampling.py
      matmul="cpu" if backend == "cpu" else "plain",
      sampler="cpu" if backend == "cpu" else "jax",
      init_from=m.init_from)


def _tristate(value: str, auto: bool) -> bool:
  return auto if value == "auto" else value == "true"


def _optim(o, backend: str, compute_dtype: str) -> OptimSpec:
  return OptimSpec(
      embedding_lr=o.embedding_lr, unembedding_lr=o.unembedding_lr, matrix_lr=o.matrix_lr,
      scalar_lr=o.scalar_lr, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
      warmdown_ratio=o.warmdown_ratio, final_lr_frac=o.final_lr_frac,
      # one matrix at a time measured faster on CPU; batched on accelerators
      muon_batched=_tristate(o.muon_batched, backend != "cpu"),
      # bfloat16 operands as in the reference (products accumulate in float32)
      polar_dtype="bfloat16" if o.polar_dtype == "auto" else o.polar_dtype,
      # the float32 Gram-space form has fewer FLOPs; accelerators run bf16 matmuls
      # several times faster than float32 ones, so there the direct iteration wins
      polar_gram=_tristate(o.polar_gram, backend == "cpu"),
      # the reference applies Muon's update in bfloat16 under bfloat16 compute
      update_dtype=(("bfloat16" if compute_dtype == "bfloat16" else "float32")
                    if o.muon_update_dtype == "auto" else o.muon_update_dtype),
      shard_optimizer=bool(o.shard_optimizer))


def resolve(cfg, backend: str | None = None) -> RunSpec:
  """The config checked and resolved for `backend` (default: this process's)."""
  config_lib.validate(cfg)
  backend = backend or jax.default_backend()
  frozen = lambda name: ml_collections.FrozenConfigDict(cfg[name])
  return RunSpec(model=_model(cfg.model, backend),
                 optim=_optim(cfg.optim, backend, cfg.model.dtype),
                 train=frozen("train"), data=frozen("data"), eval=frozen("eval"),
                 sample=frozen("sample"), log=frozen("log"), mesh=frozen("mesh"),
                 config_json=cfg.to_json())
