"""The configuration schema: defaults, the allowed values of every setting, and the checks
run on what a user wrote before anything is built.

Config files in `configs/` start from `base_config()` and change what differs; every
field can be overridden on the command line (`--config.model.n_layer=4`). Field names
follow the reference (nanochat) where it has one. What the run uses is not this
mutable dict but the frozen, resolved `spec.RunSpec` made from it once, at the
boundary (`spec.resolve`).
"""

from __future__ import annotations

import importlib.util
import math
import os

import ml_collections
from ml_collections import config_dict

from bov_jax.settings import values


class ConfigError(ValueError):
  """A setting has a value the code cannot run with."""


DTYPES = ("float32", "bfloat16", "float16")
# model.attention: `auto` becomes Splash on TPU, `blocks` on CPU, cuDNN on GPU (spec.py)
ATTENTION = ("auto", "xla", "cudnn", "blocks", "splash")
# model.decode_attention: `auto` becomes `fused_if_compiles` on TPU, `xla` elsewhere
DECODE_ATTENTION = ("auto", "xla", "fused")
# model.table_lookup (parallel/lookup.py): `auto` is `shard_map`, which gathers
# plainly wherever the table is not split
TABLE_LOOKUPS = ("auto", "shard_map", "gather", "one_hot")
# model.remat -> the jax.checkpoint_policies member each layer's backward keeps
# (None: no remat; "nothing_saveable": only the layer's inputs)
REMAT_POLICIES = {"none": None, "dots": "dots_saveable",
                  "dots_no_batch": "dots_with_no_batch_dims_saveable", "full": "nothing_saveable"}
TRISTATE = ("auto", "true", "false")
VAL_SPLITS = ("auto", "last_shard", "every_nth")
POLAR_DTYPES = ("auto", "float32", "bfloat16")


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
  m.embedding_dtype = "auto"  # the token embedding and the value tables, with their
                              # gradients and Adam moments: auto (bfloat16 under bfloat16
                              # compute, as the reference stores them; else param_dtype)
  m.init_from = ""            # an exported folder (bov_jax.export) whose weights a new run
                              # starts from (the optimizer starts fresh); "" = initialise
  m.loss_chunk = 0            # rows per cross-entropy chunk (model/loss.py); 0: 256 on
                              # CPU (cache-sized chunks), 2048 elsewhere
  m.table_lookup = "auto"     # auto | shard_map | gather | one_hot (sharding.py)
  m.attention = "auto"        # auto | xla | cudnn | blocks | splash (kernels/attention.py)
  m.attention_block = 0       # Splash attention's block rows (0: 512; a divisor of the
                              # sequence length is taken)
  m.decode_attention = "auto" # auto | xla | fused: a bank layer's decode step with the
                              # table gather inside the attention kernel (kernels/bank_decode.py)
  m.remat = "none"            # none | dots | dots_no_batch | full: what each layer's
                              # backward recomputes instead of storing
  m.scan = "auto"             # auto | true | false: repeated blocks of layers run under
                              # one lax.scan, so compile time does not grow with depth;
                              # auto: on accelerators (CPU steps run faster unrolled)
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
  t.target_flops = 1.5e18     # sets num_iterations (FLOPs per token x tokens per step)
  t.num_iterations = 0        # > 0 overrides the FLOP budget
  t.seed = 0
  t.eval_every = 250
  t.eval_tokens = 1048576     # held-out tokens per validation bpb
  t.log_every = 1
  t.checkpoint_every = 1000
  t.keep_checkpoints = 3
  t.sample_tokens = 64        # generated at the end of a run, from sample.prompt
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
  o.muon_update_dtype = "auto"  # Muon's final update lr*X + lr*wd*p*mask computed in:
                              # auto (bfloat16 under bfloat16 compute, as the reference)
                              # | float32 | bfloat16
  o.shard_optimizer = True    # on a mesh of several devices, no device repeats another's
                              # update: optimizer state split over mesh.data too (ZeRO-1),
                              # each device orthogonalising whole matrices of its own
                              # (step.py); the data replicas' gradients are reduced once a
                              # step either way

  c.data = d = ml_collections.ConfigDict()
  d.corpus = "embedded"       # embedded | a path or gs:// URL (text, JSONL, Parquet) or glob
  d.val_split = "auto"        # auto | last_shard | every_nth (corpus.py)
  d.val_every = 20            # every_nth: document i is held out iff i % val_every == 0
  d.tokenizer = ""            # a saved tokenizer (directory or tokenizer.pkl) to use instead
                              # of training one ("" = the run directory's, trained on first use)
  d.tokenizer_chars = 2_000_000_000  # characters of training text the BPE trainer reads
  d.tokenizer_doc_cap = 10_000  # characters kept of each training document (the reference's)

  c.eval = e = ml_collections.ConfigDict()
  e.core_bundle = ""          # a DCLM/nanochat eval bundle directory ("" = no CORE)
  e.core_config = ""          # the task list ("" = the authors' 21 tasks, core_tasks.yaml;
                              # a bundle's own: DIR/core.yaml)
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

  c.log = lg = ml_collections.ConfigDict()
  lg.tensorboard = True       # TensorBoard event files in the run directory
  lg.wandb_project = ""       # Weights & Biases project ("" = off; needs `pip install wandb`)
  lg.wandb_entity = ""
  lg.profile_steps = 0        # steps traced into DIR/profile/ (profiler.py; 0 = off)
  lg.profile_start_step = 2   # the first one traced (the first step a run takes compiles)

  c.mesh = ms = ml_collections.ConfigDict()
  ms.data = -1
  ms.fsdp = 1
  ms.tensor = 1
  ms.slices = 1               # TPU slices the run spans (the data-center network between
                              # them): mesh.data is split slices x (data / slices), FSDP and
                              # tensor stay inside a slice (parallel/sharding.py)
  return c


def get_config() -> ml_collections.ConfigDict:
  """The schema's defaults, for `--config` when a mode reads the run directory's config."""
  return base_config()


def depth_config(depth: int, preset: str = "gpt_base") -> ml_collections.ConfigDict:
  """The paper's shapes from depth (the reference's --depth): d = ceil(64 depth / 128) * 128,
  H = H_kv = d / 128, T = 2048, |V| = 32768, SSSL, bf16 compute.

  The optimizer settings stay at their d12 base values: the optimizer scales them by
  batch size and width (optim.hyperparams), which gives the paper's Table 6 at d24.
  """
  c = base_config()
  d = int(math.ceil(depth * 64 / 128) * 128)
  c.model.n_layer = depth
  c.model.n_embd = d
  c.model.n_head = c.model.n_kv_head = d // 128
  c.model.dtype = "bfloat16"
  c.model.value.preset = preset
  # The paper's corpus (fetch it with `python -m bov_jax.corpus download`) and its held-out
  # set: 80 x 524,288 tokens of the last shard.
  c.data.corpus = "~/.cache/bov_jax/climbmix"
  c.train.eval_tokens = 80 * 524288
  return c


def from_file(path: str) -> ml_collections.ConfigDict:
  """get_config() of a config file, by path (config files may build on each other)."""
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# -- checks -----------------------------------------------------------------------

def _positive(name, value):
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ConfigError(f"{name}={value!r}: expected a positive integer")


def _choice(name, value, allowed):
  if value not in allowed:
    raise ConfigError(f"{name}={value!r}: expected one of {', '.join(allowed)}")


# Numeric settings with a range: setting -> (integer?, lowest, highest); None is no bound.
RANGES = {
    "optim.embedding_lr": (False, 0, None), "optim.unembedding_lr": (False, 0, None),
    "optim.matrix_lr": (False, 0, None), "optim.scalar_lr": (False, 0, None),
    "optim.weight_decay": (False, 0, None), "optim.warmup_steps": (True, 0, None),
    "optim.warmdown_ratio": (False, 0, 1), "optim.final_lr_frac": (False, 0, 1),
    "train.seed": (True, 0, None), "train.eval_tokens": (True, 1, None),
    "train.sample_tokens": (True, 0, None), "train.target_flops": (False, 0, None),
    "data.tokenizer_chars": (True, 1, None), "data.tokenizer_doc_cap": (True, 1, None),
    "eval.core_max_per_task": (True, -1, None), "eval.core_every": (True, 0, None),
    "sample.max_new_tokens": (True, 0, None), "sample.temperature": (False, 0, None),
    "sample.top_k": (True, 0, None), "sample.seed": (True, 0, None),
}


def _in_range(cfg, name: str) -> None:
  integer, low, high = RANGES[name]
  section, field = name.split(".")
  value = cfg[section][field]
  kind = (int,) if integer else (int, float)
  allowed = (f"{'an integer' if integer else 'a number'}"
             + (f" in [{low}, {high}]" if high is not None else f" >= {low}"))
  if (isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value)
      or value < low or (high is not None and value > high)):
    raise ConfigError(f"{name}={value!r}: expected {allowed}")


def validate(cfg) -> None:
  """Checks every setting that is not the value mode's (values.mode_from_config checks
  those); raises ConfigError naming the setting and what is allowed. Every mode calls it
  (through spec.resolve) before it writes anything."""
  for name in RANGES:
    _in_range(cfg, name)
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
  _choice("model.attention", m.attention, ATTENTION)
  _choice("model.decode_attention", m.decode_attention, DECODE_ATTENTION)
  _choice("model.remat", m.remat, tuple(REMAT_POLICIES))
  _choice("model.scan", m.scan, TRISTATE)
  _choice("model.table_lookup", m.table_lookup, TABLE_LOOKUPS)
  for name in ("dtype", "param_dtype"):
    _choice(f"model.{name}", m[name], DTYPES)
  _choice("model.embedding_dtype", m.embedding_dtype, ("auto",) + DTYPES)
  if m.loss_chunk < 0:
    raise ConfigError(f"model.loss_chunk={m.loss_chunk}: expected >= 0 (0 = by backend)")
  if m.attention_block < 0 or m.attention_block % 128:
    raise ConfigError(f"model.attention_block={m.attention_block}: expected 0 (512) or a "
                      "multiple of 128")
  if m.short_window < 0:
    raise ConfigError(f"model.short_window={m.short_window}: expected >= 0 (0 = reference rule)")
  _choice("optim.polar_dtype", cfg.optim.polar_dtype, POLAR_DTYPES)
  _choice("optim.muon_update_dtype", cfg.optim.muon_update_dtype, POLAR_DTYPES)
  for name in ("muon_batched", "polar_gram"):
    _choice(f"optim.{name}", cfg.optim[name], TRISTATE)
  t = cfg.train
  _positive("train.batch_tokens", t.batch_tokens)
  _positive("train.device_batch_size", t.device_batch_size)
  for name in ("eval_every", "log_every", "checkpoint_every", "keep_checkpoints"):
    _positive(f"train.{name}", t[name])
  if t.num_iterations < 0:
    raise ConfigError(f"train.num_iterations={t.num_iterations}: expected >= 0 (0 = from budget)")
  if t.num_iterations == 0 and not t.target_flops > 0:
    raise ConfigError("train.target_flops must be > 0 when train.num_iterations is 0")
  _positive("data.val_every", cfg.data.val_every)
  if cfg.log.profile_steps < 0 or cfg.log.profile_start_step < 1:
    raise ConfigError(f"log.profile_steps={cfg.log.profile_steps} and log.profile_start_step="
                      f"{cfg.log.profile_start_step}: expected >= 0 steps from step >= 1")
  _choice("data.val_split", cfg.data.val_split, VAL_SPLITS)


# -- a run directory's config against the one asked for ------------------------------

# Settings a resumed run cannot change: they fix the parameters' shapes, the value
# mode, the vocabulary, or which documents and in what order the data iterator reads.
FIXED_ON_RESUME = (
    "model.n_layer", "model.n_embd", "model.n_head", "model.n_kv_head", "model.sequence_len",
    "model.vocab_size", "model.window_pattern", "model.short_window", "model.param_dtype",
    "model.embedding_dtype",
    "model.value", "data.corpus", "data.val_split", "data.val_every", "data.tokenizer",
    "train.seed", "train.batch_tokens",
)


def assign(cfg, key: str, value) -> bool:
  """Sets a dotted setting (`optim.matrix_lr`) of a ConfigDict to `value`, whatever its
  type there; False, changing nothing, when the schema has no such setting."""
  *parents, name = key.split(".")
  node = cfg
  for part in parents:
    node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
  if not (isinstance(node, ml_collections.ConfigDict) and name in node):
    return False
  with node.ignore_type():
    node[name] = value
  return True


def flatten(cfg) -> dict:
  """{"model.n_layer": 12, ...} of a ConfigDict or a plain nested dict."""
  d = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg
  out = {}

  def walk(prefix, node):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}.", v)
      else:
        out[f"{prefix}{k}"] = v
  walk("", d)
  return out


def changes(old, new) -> dict:
  """{setting: (old value, new value)} for every setting both configs have and that differs.
  The value mode is compared as resolved (a preset and its four settings are the same mode)."""
  a, b = flatten(old), flatten(new)
  out = {k: (a[k], b[k]) for k in sorted(set(a) & set(b))
         if a[k] != b[k] and not k.startswith("model.value.")}
  ma = values.mode_from_config(old["model"]["value"], old["model"]["n_layer"])
  mb = values.mode_from_config(new["model"]["value"], new["model"]["n_layer"])
  if ma.settings() != mb.settings():
    out["model.value"] = (ma.describe(), mb.describe())
  return out


def fixed_changes(delta: dict) -> dict:
  """The part of `changes(...)` a resume cannot take."""
  return {k: v for k, v in delta.items()
          if any(k == f or k.startswith(f + ".") for f in FIXED_ON_RESUME)}
