"""Benchmarks (timing claims live here, never in tests).

  python -m bov_jax.bench train  --config=FILE [--json] [--steps=N] [--profile=DIR] [--config.k=v ...]
  python -m bov_jax.bench decode --config=FILE --contexts=256,1024 [--batch=B] [--json]
  python -m bov_jax.bench dots   --config=FILE [--reference=torch] [--json] [--config.k=v ...]

`train` compiles the real train step once (random tokens, the config's
optimizer and accumulation), times warm steps and reports the median; with
--reference=torch the PyTorch transcription's steps alternate with ours in blocks
(eager); --reference=torch_compiled runs it as the reference trains, under
torch.compile (needs a C++ compiler).
`decode` builds the baseline (gpt_base) and the config's value mode at each
context length and reports the cache's allocated bytes and decode throughput.
`dots` reads every matmul of the compiled train step from its HLO (with how often
it runs) and times each shape alone: where the backend's matmul library stands on
the step's own shapes; with --reference=torch, PyTorch's time for the same ones.
It reads XLA's `dot` instructions, which is what the CPU backend keeps; GPU and TPU
compilers turn them into library calls and fusions (use `train --profile` there).
"""

from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import math
import os
import re
import statistics
import sys
import time
from typing import NamedTuple

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
                               "eager or under torch.compile; dots: torch's matmuls.")


def _emit(obj, as_json):
  print(json.dumps(obj) if as_json else "  ".join(f"{k}={v}" for k, v in obj.items()), flush=True)


def _train_setup(cfg):
  """The real compiled train step on random tokens (the config's optimizer and
  accumulation): (mesh, step, [params, opt_state], (inputs, targets), record)."""
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
  tx = optim.make(cfg, 1000, plan.hyperparams(cfg))
  with jax.set_mesh(mesh):
    opt_state = jax.jit(tx.init)(params)
    bsh = sharding.batch_sharding(mesh, leading_dims=2)
    rows = per_device * n_dev
    tokens = jax.random.randint(jax.random.key(1), (accum, rows, T + 1), 0, cfg.model.vocab_size)
    x = jax.device_put(tokens[..., :-1], bsh)
    y = jax.device_put(tokens[..., 1:], bsh)
    step = jax.jit(train.make_train_step(graphdef, tx), donate_argnums=(0, 1))
  return mesh, step, [params, opt_state], (x, y), {
      "preset": config_lib.value_mode(cfg).preset, "devices": n_dev,
      "platform": jax.devices()[0].platform, "tokens_per_step": cfg.train.batch_tokens,
      "flops_per_token": plan.flops_per_token(cfg)}


def train_stepper(cfg):
  """(run, record): run() does one step of the real compiled train step on random
  tokens (the config's optimizer and accumulation) and returns its seconds."""
  from bov_jax import plan
  mesh, step, state, (x, y), meta = _train_setup(cfg)

  def run() -> float:
    with jax.set_mesh(mesh):
      t = time.perf_counter()
      state[0], state[1], out = step(state[0], state[1], x, y)
      jax.block_until_ready(out)
      return time.perf_counter() - t

  compile_s = run()
  peak = plan.peak_flops() * meta["devices"]
  return run, {"bench": "train", "preset": meta["preset"], "devices": meta["devices"],
               "platform": meta["platform"], "tokens_per_step": meta["tokens_per_step"],
               "compile_s": compile_s, "flops_per_token": meta["flops_per_token"],
               "peak_flops": peak}


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


class Dot(NamedTuple):
  """One matmul of a compiled HLO module. lhs/rhs: (dtype, shape, layout), the
  layout minor-to-major as HLO prints it; dims: (lhs contracting, rhs contracting,
  lhs batch, rhs batch)."""
  out: str
  lhs: tuple
  rhs: tuple
  dims: tuple

  def flops(self) -> int:
    (_, ls, _), (_, rs, _) = self.lhs, self.rhs
    lc, rc, lb, rb = self.dims
    free = lambda shape, used: math.prod(d for i, d in enumerate(shape) if i not in used)
    return 2 * free(ls, lc + lb) * free(rs, rc + rb) * math.prod(ls[i] for i in lc + lb)

  def describe(self) -> str:
    (lt, ls, ll), (rt, rs, rl) = self.lhs, self.rhs
    lc, rc, lb, rb = self.dims
    dims = lambda d: "{" + ",".join(map(str, d)) + "}"
    return (f"{lt}[{','.join(map(str, ls))}]{{{ll}}} x {rt}[{','.join(map(str, rs))}]{{{rl}}} "
            f"-> {self.out}, contract {dims(lc)}x{dims(rc)}"
            + (f", batch {dims(lb)}x{dims(rb)}" if lb else ""))


_HLO_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\](?:\{([\d,]*)\})?")
_HLO_DOT = re.compile(r"= (\w+)\[[\d,]*\]\S* dot\((?:\S+ )?%([\w.\-]+), (?:\S+ )?%([\w.\-]+)\)"
                      r"(.*)")
_HLO_CALLS = re.compile(r"\b(calls|body|to_apply|condition|called_computations|"
                        r"branch_computations)=\{?(%[\w.\-]+(?:, %[\w.\-]+)*)\}?")


def hlo_dots(hlo_text: str) -> collections.Counter:
  """Dot -> how many times one run of the module executes it, from the text of a
  compiled module: each computation counted once per call, a while loop's body
  its known trip count times (a loop XLA cannot count is taken as one trip)."""
  comps, entry, name = {}, None, None
  for line in hlo_text.splitlines():
    m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
      name = m.group(2)
      comps[name] = []
      entry = name if m.group(1) else entry
    elif name is not None and line.startswith(" "):
      comps[name].append(line)
  callees = collections.defaultdict(list)  # caller -> [(callee, times per call)]
  callers = collections.Counter()
  for caller, lines in comps.items():
    for line in lines:
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
      for kind, names in _HLO_CALLS.findall(line):
        for callee in (n.strip().lstrip("%") for n in names.split(",")):
          if callee in comps:
            times = int(trip.group(1)) if kind == "body" and trip else 1
            callees[caller].append((callee, times))
            callers[callee] += 1
  runs = collections.Counter({entry: 1})
  ready = [c for c in comps if callers[c] == 0]
  while ready:  # the call graph is a DAG: a count is complete once all its callers are
    caller = ready.pop()
    for callee, times in callees[caller]:
      runs[callee] += runs[caller] * times
      callers[callee] -= 1
      if callers[callee] == 0:
        ready.append(callee)
  dots = collections.Counter()
  for comp, lines in comps.items():
    defs = {}
    for line in lines:
      m = _HLO_DEF.match(line)
      if m:
        defs[m.group(1)] = (m.group(2), tuple(int(d) for d in m.group(3).split(",") if d),
                            m.group(4) if m.group(4) is not None else "")
    for line in lines:
      m = _HLO_DOT.search(line) if " dot(" in line else None
      if m and runs[comp]:
        out, a, b, rest = m.groups()
        dims = dict(re.findall(r"(\w+_dims)=\{([\d,]*)\}", rest))
        get = lambda k: tuple(int(d) for d in dims.get(k, "").split(",") if d)
        numbers = (get("lhs_contracting_dims"), get("rhs_contracting_dims"),
                   get("lhs_batch_dims"), get("rhs_batch_dims"))
        dots[Dot(out, defs[a], defs[b], numbers)] += runs[comp]
  return dots


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


def _operand(rng, dtype, shape, layout):
  """A random operand stored as HLO lays it out, and the axes that view it logically."""
  order = [int(d) for d in layout.split(",") if d][::-1] or list(range(len(shape)))
  physical = rng.standard_normal([shape[i] for i in order]).astype("float32")
  return physical, tuple(order.index(i) for i in range(len(shape))), _DTYPES[dtype]


def time_dot(dot: Dot, reps: int = 15) -> float:
  """Best seconds of this dot alone in a jitted call (operands in its layouts), less
  the call overhead of a trivial jitted op."""
  import numpy as np
  rng = np.random.default_rng(0)
  (la, lperm, lt), (ra, rperm, rt) = (_operand(rng, *dot.lhs), _operand(rng, *dot.rhs))
  lc, rc, lb, rb = dot.dims
  out = jnp.dtype(_DTYPES[dot.out])
  f = jax.jit(lambda a, b: jax.lax.dot_general(
      a.transpose(lperm), b.transpose(rperm), ((lc, rc), (lb, rb)), preferred_element_type=out))
  return max(_best_seconds(f, (jnp.asarray(la, lt), jnp.asarray(ra, rt)), reps)
             - _call_overhead(), 1e-9)


def _best_seconds(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return min(ts)


@functools.cache
def _call_overhead() -> float:
  """Seconds of a trivial jitted call, measured once per process."""
  return _best_seconds(jax.jit(lambda a: a + 1), (jnp.ones(4),), 50)


def einsum_spec(dot: Dot) -> str:
  """The dot as an einsum over its logical operands (batch, then lhs free, rhs free
  dimensions out, as dot_general orders them)."""
  lc, rc, lb, rb = dot.dims
  letters = iter("abcdefghijklmnopqrstuvwxyz")
  lhs, rhs = [None] * len(dot.lhs[1]), [None] * len(dot.rhs[1])
  for i, j in list(zip(lb, rb)) + list(zip(lc, rc)):
    lhs[i] = rhs[j] = next(letters)
  out = "".join(lhs[i] for i in lb)
  for side in (lhs, rhs):
    for i, v in enumerate(side):
      if v is None:
        side[i] = next(letters)
        out += side[i]
  return f"{''.join(lhs)},{''.join(rhs)}->{out}"


def time_dot_torch(dot: Dot, reps: int = 15) -> float:
  """Best seconds of the same contraction in PyTorch (einsum, operands in the same
  layouts), on as many threads as this host has cores."""
  import numpy as np
  import torch
  torch.set_num_threads(os.cpu_count() or 1)
  rng = np.random.default_rng(0)
  (la, lperm, lt), (ra, rperm, rt) = (_operand(rng, *dot.lhs), _operand(rng, *dot.rhs))
  a = torch.from_numpy(la).to(getattr(torch, lt)).permute(*lperm)
  b = torch.from_numpy(ra).to(getattr(torch, rt)).permute(*rperm)
  spec = einsum_spec(dot)
  ts = []
  for _ in range(reps + 2):
    t = time.perf_counter()
    torch.einsum(spec, a, b)
    ts.append(time.perf_counter() - t)
  return min(ts[2:])


def bench_dots(cfg, reference: str | None = None) -> list[dict]:
  """A record per distinct matmul of the compiled train step (slowest total first),
  then a total record."""
  mesh, step, state, xy, meta = _train_setup(cfg)
  with jax.set_mesh(mesh):
    dots = hlo_dots(step.lower(*state, *xy).compile().as_text())
  if not dots:
    raise ValueError(f"bench dots: the compiled train step on {meta['platform']} has no HLO dot "
                     "instructions (GPU and TPU compilers turn them into library calls and "
                     "fusions); use `bench train --profile=DIR` there")
  recs = []
  for dot, n in dots.items():
    rec = {"bench": "dot", "count": n, "dot": dot.describe(), "gflop": n * dot.flops() / 1e9}
    if dot.lhs[0] in _DTYPES and dot.rhs[0] in _DTYPES and dot.out in _DTYPES:
      t = time_dot(dot)
      rec.update(xla_ms=n * t * 1e3, xla_gflops=dot.flops() / t / 1e9)
      if reference:
        t = time_dot_torch(dot)
        rec.update(torch_ms=n * t * 1e3, torch_gflops=dot.flops() / t / 1e9)
    recs.append(rec)
  recs.sort(key=lambda r: -r.get("xla_ms", 0.0))
  total = {"bench": "dots", "preset": meta["preset"], "platform": meta["platform"],
           "tokens_per_step": meta["tokens_per_step"], "dots": sum(dots.values()),
           "gflop": sum(r["gflop"] for r in recs),
           "step_model_gflop": meta["flops_per_token"] * meta["tokens_per_step"] / 1e9}
  for lib in ("xla", "torch"):
    if any(f"{lib}_ms" in r for r in recs):
      total[f"{lib}_ms"] = sum(r.get(f"{lib}_ms", 0.0) for r in recs)
      total[f"{lib}_gflops"] = (sum(r["gflop"] for r in recs if f"{lib}_ms" in r)
                                / total[f"{lib}_ms"] * 1e3)
  return recs + [total]


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
  if len(argv) != 2 or argv[1] not in ("train", "decode", "dots"):
    raise app.UsageError("usage: python -m bov_jax.bench {train|decode|dots} --config=FILE [...]")
  if _CONFIG.value is None:
    raise app.UsageError("--config=FILE is required")
  if argv[1] == "train":
    for rec in bench_train(_CONFIG.value, _STEPS.value, _WARMUP.value, _REFERENCE.value,
                           _PROFILE.value):
      _emit(rec, _JSON.value)
  elif argv[1] == "dots":
    if _REFERENCE.value == "torch_compiled":
      raise app.UsageError("dots: --reference=torch (each matmul alone, eager) or none")
    for rec in bench_dots(_CONFIG.value, _REFERENCE.value):
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
