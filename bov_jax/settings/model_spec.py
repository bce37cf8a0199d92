"""The model spec: the model section of a checked config resolved into frozen values, for
the backend the program is built for (the model and its kernels never ask the process's
backend, so a CPU host builds a TPU's program), with what several modules would
otherwise each recompute: the value mode, per-layer windows, the head dim, the stages a
scanned model compiles.
"""

from __future__ import annotations

import dataclasses
import math

from bov_jax.settings import values


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
  decode_attention: str      # xla | fused, decided for the target device (run/spec.py)
  table_lookup: str          # shard_map | gather | one_hot
  remat: str                 # a config.REMAT_POLICIES key
  loss_chunk: int
  scan: bool                 # repeated runs of layers scanned (`stages`), not unrolled
  # The target the program is built for, and the kernel forms chosen for it (the
  # kernels never ask the process's backend: a CPU host builds a TPU's program).
  platform: str              # cpu | gpu | tpu
  attention_block: int       # Splash attention's block rows (a divisor of the length is taken)
  matmul: str                # plain | cpu: kernels/matmul.py's CPU form of the backward
  sampler: str               # jax | cpu: inference/sampling.py's hand-written CPU forms
  # Where the value tables live: host memory where sampling keeps them there
  # (sample.tables_on_host: the run spec's `sample_model`); rows are then gathered there.
  tables_on_host: bool = False

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
  kinds = [(layer_value, w, i == 0 and m.value.source == "v1")
           for i, (layer_value, w) in enumerate(zip(m.layers, m.windows))]
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


def model_spec(m, backend: str) -> ModelSpec:
  """The model section of a checked config, resolved for `backend`. A TPU's decode kernel
  is left `fused_if_compiles`: whether it compiles is asked of the target device, where
  the run spec is resolved (run/spec.py)."""
  mode = values.mode_from_config(m.value, m.n_layer)
  attention = m.attention
  if attention == "auto":
    attention = {"tpu": "splash", "cpu": "blocks", "gpu": "cudnn"}.get(backend, "xla")
  if attention == "cudnn" and not (backend == "gpu" and m.dtype in ("bfloat16", "float16")
                                   and (m.n_embd // m.n_head) % 8 == 0
                                   and m.n_embd // m.n_head <= 128):
    attention = "xla"  # what cuDNN's flash attention takes: a GPU, half precision, dh <= 128
  return ModelSpec(
      n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, n_kv_head=m.n_kv_head,
      sequence_len=m.sequence_len, vocab_size=m.vocab_size, windows=window_sizes(m),
      value=mode, dtype=m.dtype, param_dtype=m.param_dtype,
      # the reference stores these in bfloat16 under bfloat16 compute (docs/design.md)
      embedding_dtype=(("bfloat16" if m.dtype == "bfloat16" else m.param_dtype)
                       if m.embedding_dtype == "auto" else m.embedding_dtype),
      attention=attention,
      decode_attention=(("fused_if_compiles" if backend == "tpu" else "xla")
                        if m.decode_attention == "auto" else m.decode_attention),
      table_lookup="shard_map" if m.table_lookup == "auto" else m.table_lookup,
      remat=m.remat,
      # XLA's CPU backend runs the unrolled step faster and compiles it in less time
      scan=tristate(m.scan, backend != "cpu"),
      # cache-sized chunks on CPU; large ones keep an accelerator's matmuls full
      loss_chunk=m.loss_chunk or (256 if backend == "cpu" else 2048),
      platform=backend,
      attention_block=m.attention_block or 512,
      # XLA's CPU backend: see kernels/matmul.py and kernels/sampling.py
      matmul="cpu" if backend == "cpu" else "plain",
      sampler="cpu" if backend == "cpu" else "jax")


def tristate(value: str, auto: bool) -> bool:
  """A setting of auto | true | false: `auto` is what the backend takes."""
  return auto if value == "auto" else value == "true"
