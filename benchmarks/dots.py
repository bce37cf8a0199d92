"""The train step's matmuls, each timed alone.

  python -m benchmarks.dots --config=FILE [--reference=torch] [--json] [--config.k=v ...]

Reads every `dot` of the compiled train step from its HLO, with how often one step
runs it (while-loop trip counts and nested computations included), and times each
distinct shape alone: a jitted call of that one dot, its operands in the step's
layouts, best of 15, less a trivial call's overhead. With --reference=torch, also
PyTorch's time for the same contraction. Prints a record per distinct dot (slowest
total first), then a total record. It reads XLA's `dot` instructions, which is what
the CPU backend keeps; GPU and TPU compilers turn them into library calls and
fusions (use `benchmarks.train --profile` there).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from absl import logging

from benchmarks import common
from bov_jax import cli
from bov_jax.host import extras

_REFERENCE = flags.DEFINE_enum("reference", None, ["torch"],
                               "Also time each matmul in PyTorch (eager, needs torch).")


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
HLO_CALLS = re.compile(r"\b(calls|body|to_apply|condition|called_computations|"
                        r"branch_computations)=\{?(%[\w.\-]+(?:, %[\w.\-]+)*)\}?")


def _counted_trips(while_line: str, comps: dict) -> int:
  """A while loop's trips from its condition, where the compiler printed no
  known_trip_count (the TPU compiler's modules): `counter < N` on an element of the loop's
  tuple, with one integer constant N, counted from 0 by the constant the body adds to
  that element (1 where it adds none it names): lax.scan's and fori_loop's loop (an s32
  counter at element 0, by 1) and the TPU compiler's windowed matmuls' (a u32 counter,
  by the ring steps each trip runs). Else 1."""
  m = re.search(r"condition=%?([\w.\-]+)", while_line)
  cond = comps.get(m.group(1), []) if m else []
  consts = [int(c) for line in cond
            for c in re.findall(r"[su]32\[\]\S* constant\((\d+)\)", line)]
  root = [line for line in cond if "ROOT" in line]
  index = [re.search(r"index=(\d+)", line) for line in cond if "get-tuple-element" in line]
  if not (len(consts) == 1 and root and "direction=LT" in root[0] and index and index[0]):
    return 1
  m = re.search(r"body=%?([\w.\-]+)", while_line)
  body = comps.get(m.group(1), []) if m else []
  name = lambda line: re.match(r"\s*(?:ROOT )?%([\w.\-]+) =", line)
  counter = {name(line).group(1) for line in body if name(line) and "get-tuple-element(" in line
             and f"index={index[0].group(1)}" in line}
  values = {name(line).group(1): int(c.group(1)) for line in body if name(line)
            and (c := re.search(r"[su]32\[\]\S* constant\((\d+)\)", line))}
  lines = {name(line).group(1): line for line in body if name(line)}
  root = next((line for line in body if line.lstrip().startswith("ROOT")), "")
  out = re.search(r" tuple\((.*)\)", root)
  nxt = out.group(1).split(", ")[int(index[0].group(1))].split()[-1].lstrip("%") if out else ""
  add = re.search(r" add\(%([\w.\-]+), %([\w.\-]+)\)", lines.get(nxt, ""))
  by = values.get(add.group(2), 1) if add and add.group(1) in counter else 1
  return -(-consts[0] // max(by, 1))


def hlo_runs(hlo_text: str) -> tuple[dict, collections.Counter]:
  """({computation: its instruction lines}, computation -> how many times one run of
  the module executes it), from the text of a compiled module: each computation counted
  once per call, a while loop's body its known trip count times (a loop XLA cannot
  count is taken as one trip)."""
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
      trips = int(trip.group(1)) if trip else _counted_trips(line, comps)
      for kind, names in HLO_CALLS.findall(line):
        for callee in (n.strip().lstrip("%") for n in names.split(",")):
          if callee in comps:
            times = trips if kind == "body" else 1
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
  return comps, runs


def hlo_dots(hlo_text: str) -> collections.Counter:
  """Dot -> how many times one run of the module executes it (`hlo_runs`)."""
  comps, runs = hlo_runs(hlo_text)
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
  torch = extras.require("torch", "torch", "timing dots in PyTorch")
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


def bench_dots(spec, reference: str | None = None) -> list[dict]:
  """A record per distinct matmul of the compiled train step (slowest total first),
  then a total record."""
  stepper = common.TrainStep(spec)
  meta = stepper.record()
  dots = hlo_dots(stepper.compiled_text())
  if not dots:
    raise ValueError(f"benchmarks.dots: the compiled train step on {meta['platform']} has no HLO "
                     "dot instructions (GPU and TPU compilers turn them into library calls and "
                     "fusions); use `python -m benchmarks.train --profile=DIR` there")
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


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for rec in bench_dots(common.spec_from_flags(), _REFERENCE.value):
    common.emit(rec)


if __name__ == "__main__":
  from bov_jax.host import hugepages
  hugepages.reexec_with_huge_pages()  # as bov_jax.main does on CPU: see hugepages.py
  cli.run(main)  # a missing extra: one line, exit 1
