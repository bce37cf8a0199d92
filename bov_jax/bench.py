"""Benchmarks (timing claims live here, never in tests).

  python -m bov_jax.bench train  --config=FILE [--json] [--steps=N] [--profile=DIR] [--config.k=v ...]
  python -m bov_jax.bench decode --config=FILE --contexts=256,1024 [--batch=B] [--json]

`train` compiles the real train step once (random tokens, the config's
optimizer and accumulation), times warm steps and reports the median; with
--reference=torch the PyTorch transcription's steps alternate with ours in blocks
(eager); --reference=torch_compiled runs it as the reference trains, under
torch.compile (needs a C++ compiler).
`decode` builds the baseline (gpt_base) and the config's value mode at each
context length and reports the cache's allocated bytes and decode throughput.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from absl import logging
from flax import nnx
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file.")
_JSON = flags.DEFINE_bool("json", False, "Print JSON lines only.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (train) / decode steps per context.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
_CONTEXTS = flags.DEFINE_string("contexts", "256,1024", "Context lengths (decode).")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences decoded together (decode).")
_PROFILE = flags.DEFINE_string("profile", None, "train: after timing, trace one more step "
                               "with jax.profiler into this folder (TensorBoard/XProf, and a "
                               "Perfetto JSON).")
_REFERENCE = flags.DEFINE_enum("reference", None, ["torch", "torch_compiled"],
                               "train: also time the PyTorch transcription (needs torch), "
                               "eager or under torch.compile.")


def _emit(obj, as_json):
  print(json.dumps(obj) if as_json else "  ".join(f"{k}={v}" for k, v in obj.items()), flush=True)


def train_stepper(cfg):
  """(run, record): run() does one step of the real compiled train step on random
  tokens (the config's optimizer and accumulation) and returns its seconds."""
  from bov_jax import config as config_lib
  from bov_jax import optim
  from bov_jax import plan
  from bov_jax import sharding
  from bov_jax import train
  config_lib.validate(cfg)
  mesh = sharding.make_mesh(cfg)
  n_dev = jax.device_count()
  per_device = train.micro_batch_rows(cfg, n_dev)
  T = cfg.model.sequence_len
  accum = cfg.train.batch_tokens // (per_device * n_dev * T)
  graphdef, params, _ = train.init_params(cfg, mesh, jax.random.key(0))
  fpt = plan.flops_per_token(cfg)
  tx = optim.make(cfg, 1000, plan.hyperparams(cfg))
  with jax.set_mesh(mesh):
    opt_state = jax.jit(tx.init)(params)
    bsh = sharding.batch_sharding(mesh, leading_dims=2)
    rows = per_device * n_dev
    tokens = jax.random.randint(jax.random.key(1), (accum, rows, T + 1), 0, cfg.model.vocab_size)
    x = jax.device_put(tokens[..., :-1], bsh)
    y = jax.device_put(tokens[..., 1:], bsh)
    step = jax.jit(train.make_train_step(graphdef, tx), donate_argnums=(0, 1))
  state = [params, opt_state]

  def run() -> float:
    with jax.set_mesh(mesh):
      t = time.perf_counter()
      state[0], state[1], out = step(state[0], state[1], x, y)
      jax.block_until_ready(out)
      return time.perf_counter() - t

  compile_s = run()
  peak = plan.peak_flops() * n_dev
  return run, {"bench": "train", "preset": config_lib.value_mode(cfg).preset, "devices": n_dev,
               "platform": jax.devices()[0].platform,
               "tokens_per_step": cfg.train.batch_tokens, "compile_s": compile_s,
               "flops_per_token": fpt, "peak_flops": peak}


def time_interleaved(runs: dict, steps: int, warmup: int, block: int = 5) -> dict:
  """Median seconds of each run() over `steps` timed steps. The runs take turns in
  blocks of `block` steps, each block after one untimed step: a noisy host's slow
  minutes fall on all of them alike, and each is timed in its own steady state
  (caches and allocator warm from its own previous step, not the other's)."""
  for _ in range(warmup):
    for run in runs.values():
      run()
  times = {name: [] for name in runs}
  while any(len(ts) < steps for ts in times.values()):
    for name, run in runs.items():
      run()
      times[name] += [run() for _ in range(min(block, steps - len(times[name])))]
  return {name: statistics.median(ts) for name, ts in times.items()}


KERNEL_KINDS = (  # what a kernel's name says it is (cuDNN, cuBLAS/CUTLASS, XLA's own)
    ("attention", ("sdpa", "fmha", "flash")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "dot", "matmul", "wgmma")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset")),
    ("reduce", ("reduce",)),
    ("scatter/gather", ("scatter", "gather", "dynamic")),
)
HOST_WRAPPERS = ("$", "ThunkExecutor", "SlinkyThreadPool")  # CPU events that enclose ops


def profile_summary(trace_dir: str, top: int = 25) -> str:
  """A table of where one traced step's time went: the newest Perfetto trace under
  trace_dir, on the accelerator's streams (or the CPU's XLA threads), summed by
  kernel and, on an accelerator, by kind. jax.profiler writes the trace; nothing
  in jax tabulates it without TensorBoard, which a headless TPU/GPU host usually
  lacks."""
  files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
  if not files:
    return f"no perfetto_trace.json.gz under {trace_dir}/plugins/profile"
  trace = json.load(gzip.open(max(files, key=os.path.getmtime)))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[e["pid"], e["tid"]] = e["args"]["name"]
  device = {p for p, n in procs.items() if n.startswith("/device:")}
  streams = {k for k, n in threads.items() if k[0] in device and "stream" in n.lower()}

  def counted(e):
    key = (e.get("pid"), e.get("tid"))
    if streams:
      return key in streams
    if device:
      return key[0] in device
    return "XLA" in threads.get(key, "") and not e.get("name", "").startswith(HOST_WRAPPERS)

  by_name, by_thread = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e and counted(e):
      by_thread[threads.get((e["pid"], e["tid"]), str(e["tid"]))] += e["dur"]
      by_name[e["name"]] += e["dur"]
  total = sum(by_name.values()) or 1.0
  lines = [f"profile: {total / 1e3:.1f} ms of kernels/ops in one step ({trace_dir}), on "
           + ", ".join(f"{n} {us / 1e3:.1f} ms" for n, us in by_thread.most_common(6))]
  if device:
    by_kind = collections.Counter()
    for name, us in by_name.items():
      by_kind[next((k for k, words in KERNEL_KINDS if any(w in name.lower() for w in words)),
                   "other (fused elementwise)")] += us
    lines += [f"  {us / 1e3:9.2f} ms {us / total:6.1%}  {kind}"
              for kind, us in by_kind.most_common()]
  else:  # a CPU fusion's name ("ynn_fusion.2") says nothing of whether it holds a matmul
    lines.append("  (by kind: accelerators only; XLA's CPU fusion names do not say what they compute)")
  lines += [f"  {us / 1e3:9.2f} ms {us / total:6.1%}  {name[:110]}"
            for name, us in by_name.most_common(top)]
  return "\n".join(lines)


def bench_train(cfg, steps: int, warmup: int, reference: str | None = None,
                profile: str | None = None) -> list[dict]:
  """The train record (last), after the reference's record when one is asked for."""
  run, rec = train_stepper(cfg)
  runs = {"bov_jax": run}
  if reference is not None:
    from bov_jax import torch_reference  # imports torch
    runs["torch"], ref = torch_reference.make_step(cfg, compiled=reference == "torch_compiled")
  dt = time_interleaved(runs, steps, warmup)
  if profile:
    with jax.profiler.trace(profile, create_perfetto_trace=True):
      run()
    print(profile_summary(profile), file=sys.stderr, flush=True)
  tps = cfg.train.batch_tokens / dt["bov_jax"]
  rec.update(step_s=dt["bov_jax"], tokens_per_s=tps, achieved_flops=tps * rec["flops_per_token"],
             mfu=tps * rec["flops_per_token"] / rec["peak_flops"])
  if reference is None:
    return [rec]
  ref.update(step_s=dt["torch"], tokens_per_s=ref["tokens_per_step"] / dt["torch"])
  rec.update(reference_tokens_per_s=ref["tokens_per_s"],
             speedup_vs_reference=rec["tokens_per_s"] / ref["tokens_per_s"])
  return [ref, rec]


def bench_decode(cfg, contexts, batch: int, steps: int) -> list[dict]:
  from bov_jax import config as config_lib
  from bov_jax import inference
  from bov_jax import model as model_lib
  out = []
  mode = config_lib.value_mode(cfg)
  presets = ["gpt_base"] + ([mode.preset or "(config)"] if not mode.is_baseline else [])
  for preset in presets:
    c = cfg.copy_and_resolve_references()
    if preset == "gpt_base":
      c.model.value.preset = "gpt_base"
      for k in ("source", "combine", "coeff", "layers", "shared_table"):
        c.model.value[k] = None
    for context in contexts:
      c.model.sequence_len = max(c.model.sequence_len, context)
      model = model_lib.init_model(c, jax.random.key(0))
      graphdef, state = nnx.split(model)
      params = nnx.to_pure_dict(state)
      n_steps = min(steps, context - 1)
      prompt_len = context - n_steps

      @jax.jit
      def prefill(params, prompts):
        m = nnx.merge(graphdef, params)
        logits, cache = inference.forward_cached(m, prompts, inference.init_cache(m, batch,
                                                                                 context))
        return logits[:, -1], cache

      @jax.jit
      def decode(params, last, cache):
        m = nnx.merge(graphdef, params)

        def body(t, carry):
          last, cache = carry
          tok = inference.greedy(last)
          logits, cache = inference.forward_cached(m, tok[:, None], cache)
          return logits[:, 0], cache

        return jax.lax.fori_loop(0, n_steps, body, (last, cache))

      prompts = jax.random.randint(jax.random.key(2), (batch, prompt_len), 0, c.model.vocab_size)
      last, cache = prefill(params, prompts)
      jax.block_until_ready(decode(params, last, cache))  # compile
      t = time.perf_counter()
      jax.block_until_ready(decode(params, last, cache))
      dt = time.perf_counter() - t
      a = model.blocks[0].attn
      out.append({"bench": "decode", "preset": preset, "context": context, "batch": batch,
                  "cache_bytes": inference.cache_bytes(cache),
                  "n_bank_layers": len(inference.bank_layers(model)),
                  "kv_dim": a.n_kv_head * a.head_dim,
                  "bytes_per_element": jnp.dtype(model.compute_dtype).itemsize,
                  "decode_steps": n_steps, "tokens_per_s": batch * n_steps / dt})
  return out


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) != 2 or argv[1] not in ("train", "decode"):
    raise app.UsageError("usage: python -m bov_jax.bench {train|decode} --config=FILE [...]")
  if _CONFIG.value is None:
    raise app.UsageError("--config=FILE is required")
  if argv[1] == "train":
    for rec in bench_train(_CONFIG.value, _STEPS.value, _WARMUP.value, _REFERENCE.value,
                           _PROFILE.value):
      _emit(rec, _JSON.value)
  else:
    contexts = [int(c) for c in _CONTEXTS.value.split(",") if c.strip()]
    for rec in bench_decode(_CONFIG.value, contexts, _BATCH.value, _STEPS.value):
      _emit(rec, _JSON.value)
  return 0


if __name__ == "__main__":
  from bov_jax import hostmem
  hostmem.reexec_with_huge_pages()  # as bov_jax.main does: see hostmem.py
  app.run(main)
