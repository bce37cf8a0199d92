"""Where one traced step's time went, from jax.profiler's Perfetto trace: nothing in jax
tabulates a trace without TensorBoard, which a headless TPU/GPU host usually lacks."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

KERNEL_KINDS = (  # what a kernel's name says it is (cuDNN, cuBLAS/CUTLASS, XLA's own)
    ("attention", ("sdpa", "fmha", "flash")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "dot", "matmul", "wgmma")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset")),
    ("reduce", ("reduce",)),
    ("scatter/gather", ("scatter", "gather", "dynamic")),
)
HOST_WRAPPERS = ("$", "ThunkExecutor", "SlinkyThreadPool")  # CPU events that are no op
# What an HLO instruction computes, by the opcodes in it (and in what it calls), first
# match wins: on CPU the trace names instructions ("ynn_fusion.2"), not kernels.
HLO_KINDS = (("matmul", ("dot", "convolution")),
             ("scatter/gather", ("scatter", "gather", "dynamic-slice", "dynamic-update-slice")),
             ("reduce", ("reduce", "reduce-window")),
             ("copy/transpose", ("copy", "transpose")))
_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\s([a-z][\w\-]*)\(")
_HLO_CALLED = re.compile(r"\b(?:calls|to_apply|body)=%([\w.\-]+)")


def hlo_kinds(hlo_text: str) -> dict:
  """{instruction name: kind} of a compiled module's instructions (HLO_KINDS, else
  "elementwise"), a fusion or loop by everything it runs."""
  comps, ops, calls, name = {}, {}, {}, None
  for line in hlo_text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
      name = m.group(1)
      comps[name] = []
      continue
    m = _HLO_INSTR.match(line)
    if m and name is not None:
      comps[name].append(m.group(1))
      ops[m.group(1)] = m.group(2)
      calls[m.group(1)] = _HLO_CALLED.findall(line)

  def opcodes(instr, seen):
    out = {ops[instr]}
    for comp in calls.get(instr, ()):
      if comp not in seen:
        seen.add(comp)
        for inner in comps.get(comp, ()):
          out |= opcodes(inner, seen)
    return out

  kinds = {}
  for instr in ops:
    found = opcodes(instr, set())
    kinds[instr] = next((k for k, codes in HLO_KINDS if found & set(codes)), "elementwise")
  return kinds


def _leaves(events):
  """The events no other event of the same thread encloses (a CPU loop or thunk holds
  the ops it runs; only those are counted)."""
  out = []
  by_thread = collections.defaultdict(list)
  for e in events:
    by_thread[e["pid"], e["tid"]].append(e)
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    for i, e in enumerate(evs):
      nxt = evs[i + 1] if i + 1 < len(evs) else None
      if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]:
        out.append(e)
  return out


def profile_summary(trace_dir: str, top: int = 25, hlo_text: str | None = None) -> str:
  """A table of where one traced step's time went: the newest Perfetto trace under
  trace_dir, on the accelerator's streams (or the CPU's XLA threads, each op counted
  once, not the loops and thunks that hold it), summed by kernel and by kind (on CPU
  from `hlo_text`, the compiled step, where given)."""
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
  # the profiler's own rows ("/device:CUSTOM:Megascale Trace") are no device
  device = {p for p, n in procs.items() if n.startswith("/device:") and ":CUSTOM:" not in n}
  streams = {k for k, n in threads.items() if k[0] in device and "stream" in n.lower()}

  def counted(e):
    key = (e.get("pid"), e.get("tid"))
    if streams:
      return key in streams
    if device:
      return key[0] in device
    return "XLA" in threads.get(key, "") and not e.get("name", "").startswith(HOST_WRAPPERS)

  ops = [e for e in events if e.get("ph") == "X" and "dur" in e and counted(e)]
  if not device:  # XLA's CPU runtime tags each op it runs with `hlo_op`; markers have none
    tagged = [e for e in ops if "hlo_op" in e.get("args", {})]
    ops = _leaves(tagged or ops)
  by_name, by_thread = collections.Counter(), collections.Counter()
  for e in ops:
    by_thread[threads.get((e["pid"], e["tid"]), str(e["tid"]))] += e["dur"]
    by_name[e["name"]] += e["dur"]
  total = sum(by_name.values()) or 1.0
  lines = [f"profile: {total / 1e3:.1f} ms of kernels/ops in one step ({trace_dir}), on "
           + ", ".join(f"{n} {us / 1e3:.1f} ms" for n, us in by_thread.most_common(6))]
  kinds = hlo_kinds(hlo_text) if hlo_text and not device else None
  if device or kinds:
    by_kind = collections.Counter()
    for name, us in by_name.items():
      if kinds:
        kind = kinds.get(name, "other")
      else:
        kind = next((k for k, words in KERNEL_KINDS if any(w in name.lower() for w in words)),
                    "other (fused elementwise)")
      by_kind[kind] += us
    lines += [f"  {us / 1e3:9.2f} ms {us / total:6.1%}  {kind}"
              for kind, us in by_kind.most_common()]
  else:  # a CPU fusion's name ("ynn_fusion.2") says nothing of whether it holds a matmul
    lines.append("  (by kind: from the compiled step's HLO, hlo_text; XLA's CPU fusion names "
                 "do not say what they compute)")
  lines += [f"  {us / 1e3:9.2f} ms {us / total:6.1%}  {name[:110]}"
            + (f"  [{kinds.get(name, 'other')}]" if kinds else "")
            for name, us in by_name.most_common(top)]
  return "\n".join(lines)
