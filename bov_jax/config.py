"""The configuration schema, its defaults, and the checks run before anything is built.

Config files in `configs/` start from `base_config()` and change what differs;
every field can be overridden on the command line (`--config.model.n_layer=4`).
Field names follow the reference (nanochat) where it has one.
"""

from __future__ import annotations

import math

import ml_collections
from ml_collections import config_dict

from bov_jax import attention
from bov_jax import values


class ConfigError(ValueError):
  """A setting has a value the code cannot run with."""


DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "dots", "dots_no_batch", "full")


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.model = m = ml_collections.ConfigDict()
  m.n_layer = 12
  m.n_embd = 768
  m.n_head = 6
  m.n_kv_head = 6
  m.sequence_len = 2048
  m.vocab_size = 32768
  m.window_pattern = "SSSL"
  m.short_window = 0          # 0: the reference's rule, ceil((T // 4) / 128) * 128
  m.dtype = "float32"         # compute dtype (bfloat16 on accelerators)
  m.param_dtype = "float32"   # master weights
  m.loss_chunk = 0            # rows per cross-entropy chunk (losses.py); 0: 256 on CPU
                              # (cache-sized chunks measured fastest), 2048 elsewhere
  m.table_lookup = "auto"     # auto | shard_map | gather | one_hot (see sharding.py)
  m.attention = "auto"        # auto | xla | cudnn | blocks | splash (see attention.py)
  m.decode_attention = "auto" # auto | xla | fused: a bank layer's decode step with the
                              # table gather inside the attention kernel (bank_decode.py)
  m.remat = "none"            # none | dots | dots_no_batch | full: what each layer's
                              # backward recomputes instead of storing (model.REMAT)
  m.value = v = ml_collections.ConfigDict()
  v.preset = ""               # a reference model_type name; sets the four below
  v.source = config_dict.placeholder(str)    # residual | x0 | v1 | table
  v.combine = config_dict.placeholder(str)   # replace | add | gated_add | scale
  v.coeff = config_dict.placeholder(str)     # fixed | learned
  v.layers = config_dict.placeholder(str)    # last_third | every_other | ... | "8,9"
  v.shared_table = config_dict.placeholder(bool)

  c.train = t = ml_collections.ConfigDict()
  t.batch_tokens = 524288     # tokens per optimizer step (all devices, all micro-batches)
  t.device_batch_size = 16    # rows per device per micro-batch
  t.target_flops = 1.5e18     # sets num_iterations (SPEC section 3)
  t.num_iterations = 0        # > 0 overrides the FLOP budget
  t.seed = 0
  t.eval_every = 250
  t.eval_tokens = 1048576     # held-out tokens per validation bpb
  t.log_every = 1
  t.checkpoint_every = 1000
  t.keep_checkpoints = 3
  t.sample_tokens = 64        # generated at the end of a run
  t.compile_cache_dir = "~/.cache/bov_jax/jax"  # JAX's persistent compilation cache: a
                              # restart or resume loads the compiled step ("" = off;
                              # the JAX_COMPILATION_CACHE_DIR environment variable wins)

  c.optim = o = ml_collections.ConfigDict()
  o.embedding_lr = 0.3
  o.unembedding_lr = 0.008
  o.matrix_lr = 0.02
  o.scalar_lr = 0.5
  o.weight_decay = 0.28
  o.warmup_steps = 40
  o.warmdown_ratio = 0.65
  o.final_lr_frac = 0.05
  o.muon_batched = "auto"     # batch Polar Express over same-shaped matrices: auto|true|false
  o.polar_dtype = "auto"      # Polar Express matmul operands: auto (bfloat16, as in the
                              # reference; float32 accumulation) | float32 | bfloat16
  o.polar_gram = "auto"       # float32 Gram-space Polar Express for matrices of aspect
                              # >= 1.5: auto (on CPU) | true | false

  c.data = d = ml_collections.ConfigDict()
  d.corpus = "embedded"       # embedded | a path (text, JSONL, Parquet) or glob
  d.tokenizer_chars = 200_000_000  # characters of training text the BPE trainer reads
  d.val_every = 20            # document i is held out iff i % val_every == 0

  c.eval = e = ml_collections.ConfigDict()
  e.core_bundle = ""          # a DCLM/nanochat eval bundle directory ("" = no CORE)
  e.core_max_per_task = -1    # items per task (-1 = all)
  e.core_every = 0            # CORE every N training steps and at the end (0 = never)

  c.sample = sm = ml_collections.ConfigDict()
  sm.prompt = "def "
  sm.max_new_tokens = 64
  sm.temperature = 0.0        # 0 = greedy
  sm.top_k = 0                # 0 = no top-k filter
  sm.seed = 0
  sm.use_cache = True         # False: recompute the full forward pass per token
  sm.tables_on_host = False   # keep value tables in host memory, fetch rows per step

  c.mesh = ms = ml_collections.ConfigDict()
  ms.data = -1
  ms.fsdp = 1
  ms.tensor = 1
  return c


def depth_config(depth: int, preset: str = "gpt_base") -> ml_collections.ConfigDict:
  """The paper's shapes from depth (the reference's --depth): d = ceil(64 depth / 128) * 128,
  H = H_kv = d / 128, T = 2048, |V| = 32768, SSSL, bf16 compute.

  The optimizer settings stay at their d12 base values: the code scales them by
  batch size and width (SPEC section 4), which gives Table 6's d24 numbers.
  """
  c = base_config()
  d = int(math.ceil(depth * 64 / 128) * 128)
  c.model.n_layer = depth
  c.model.n_embd = d
  c.model.n_head = c.model.n_kv_head = d // 128
  c.model.dtype = "bfloat16"
  c.model.value.preset = preset
  return c


def short_window(cfg) -> int:
  T = cfg.model.sequence_len
  if cfg.model.short_window > 0:
    return cfg.model.short_window
  return int(math.ceil((T // 4) / 128) * 128)


def window_sizes(cfg) -> list[int]:
  """Per-layer attention window w: query i sees key j iff 0 <= i - j <= w."""
  pattern = cfg.model.window_pattern.upper()
  T = cfg.model.sequence_len
  sizes = {"L": T, "S": short_window(cfg)}
  ws = [sizes[pattern[i % len(pattern)]] for i in range(cfg.model.n_layer)]
  ws[-1] = T  # the last layer always sees the full context
  return ws


def head_dim(cfg) -> int:
  return cfg.model.n_embd // cfg.model.n_head


def value_mode(cfg) -> values.ValueMode:
  return values.resolve(cfg.model.value, cfg.model.n_layer)


def _positive(name, value):
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ConfigError(f"{name}={value!r}: expected a positive integer")


def validate(cfg) -> values.ValueMode:
  """Checks the whole config; returns the resolved value mode."""
  m = cfg.model
  for name in ("n_layer", "n_embd", "n_head", "n_kv_head", "sequence_len", "vocab_size"):
    _positive(f"model.{name}", m[name])
  if m.n_embd % m.n_head:
    raise ConfigError(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
  if m.n_head % m.n_kv_head:
    raise ConfigError(
        f"model.n_head={m.n_head} must be a multiple of model.n_kv_head={m.n_kv_head} (GQA)")
  if (m.n_embd // m.n_head) % 2:
    raise ConfigError(
        f"head dim model.n_embd/model.n_head={m.n_embd // m.n_head} must be even (rotary)")
  pattern = str(m.window_pattern).upper()
  if not pattern or set(pattern) - {"S", "L"}:
    raise ConfigError(
        f"model.window_pattern={m.window_pattern!r}: expected a string of S and L such as 'SSSL'")
  if m.attention not in attention.IMPLS:
    raise ConfigError(f"model.attention={m.attention!r}: expected one of "
                      f"{', '.join(attention.IMPLS)}")
  if m.attention == "splash" and not attention.splash_fits(m.sequence_len):
    raise ConfigError(f"model.attention='splash' needs model.sequence_len to be a multiple of "
                      f"{attention.SPLASH_BLOCK} (Splash's block rows); got {m.sequence_len}")
  from bov_jax import bank_decode
  if m.get("decode_attention", "auto") not in bank_decode.IMPLS:
    raise ConfigError(f"model.decode_attention={m.decode_attention!r}: expected one of "
                      f"{', '.join(bank_decode.IMPLS)}")
  if m.remat not in REMAT_POLICIES:
    raise ConfigError(f"model.remat={m.remat!r}: expected one of {', '.join(REMAT_POLICIES)}")
  if m.loss_chunk < 0:
    raise ConfigError(f"model.loss_chunk={m.loss_chunk}: expected >= 0 (0 = by backend)")
  if m.short_window < 0:
    raise ConfigError(f"model.short_window={m.short_window}: expected >= 0 (0 = reference rule)")
  for name in ("dtype", "param_dtype"):
    if m[name] not in DTYPES:
      raise ConfigError(f"model.{name}={m[name]!r}: expected one of {', '.join(DTYPES)}")
  from bov_jax import sharding
  if m.table_lookup not in sharding.LOOKUPS:
    raise ConfigError(f"model.table_lookup={m.table_lookup!r}: expected one of "
                      f"{', '.join(sharding.LOOKUPS)}")
  mode = values.resolve(m.value, m.n_layer)
  if mode.combine == "gated_add" and m.n_embd < values.GATE_CHANNELS:
    raise ConfigError(
        f"model.value.combine='gated_add' reads {values.GATE_CHANNELS} channels; "
        f"model.n_embd={m.n_embd} is smaller")
  if cfg.optim.polar_dtype not in ("auto", "float32", "bfloat16"):
    raise ConfigError(f"optim.polar_dtype={cfg.optim.polar_dtype!r}: expected auto, float32 "
                      "or bfloat16")
  for name in ("muon_batched", "polar_gram"):
    if cfg.optim[name] not in ("auto", "true", "false"):
      raise ConfigError(f"optim.{name}={cfg.optim[name]!r}: expected auto, true or false")
  t = cfg.train
  _positive("train.batch_tokens", t.batch_tokens)
  _positive("train.device_batch_size", t.device_batch_size)
  if t.num_iterations < 0:
    raise ConfigError(f"train.num_iterations={t.num_iterations}: expected >= 0 (0 = from budget)")
  if t.num_iterations == 0 and not t.target_flops > 0:
    raise ConfigError("train.target_flops must be > 0 when train.num_iterations is 0")
  return mode
