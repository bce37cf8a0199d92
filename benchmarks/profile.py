"""Where one traced step's time went, from jax.profiler's Perfetto trace: nothing in jax
tabulates a trace without TensorBoard, which a headless TPU/GPU host usually lacks."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

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
    lines.append("  (by kind: accelerators only; XLA's CPU fusion names do not say what they "
                 "compute)")
  lines += [f"  {us / 1e3:9.2f} ms {us / total:6.1%}  {name[:110]}"
            for name, us in by_name.most_common(top)]
  return "\n".join(lines)


