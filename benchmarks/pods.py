"""The paper configs on TPU slices, compiled on this host: docs/pods.md's table.

  python -m benchmarks.pods --runs=bov_780m:v5p-64,baseline_780m:v5p-64 \
      [--programs=train,decode] [--set=model.remat=full ...: every run] [--json]

For each CONFIG:TOPOLOGY (a file under configs/ and a gcloud accelerator type) it runs
`--mode=compile`'s programs (bov_jax.aot) and reads the compiled train step's
collectives from its HLO, each counted as often as one step runs it (while-loop trip
counts applied, `benchmarks.dots.hlo_runs`): the bytes each chip all-gathers (an
all-gather's result), reduce-scatters and all-reduces (their operand), sends through
all-to-alls and collective permutes (the TPU compiler turns many gathers and scatters
into rings of permutes). Beside them, what the step needs at the least (`floor`): with
FSDP, every block weight gathered for the forward and for the backward and its gradient
reduce-scattered (per micro-batch); over data replicas, the gradients reduced once
(reduce-scattered into the optimizer's shards and the new parameters all-gathered, or
all-reduced where the update is not split), and `gathered_reduced_vs_floor`, the bytes
gathered and reduced (permutes included) against the floor's (`all_vs_floor`: the
all-to-alls too). With the train step it compiles the update alone, as the step runs it
(`step.build`'s `update_step`): `optimizer_flops_per_chip` (the compiler's cost
analysis) against `model_flops_per_chip` (`plan.flops_per_token` x `train.batch_tokens`
/ chips). One record per run.

Over several slices (2xv5p-64, or --set=mesh.slices=2) the TPU compiler compiles one
slice's program: its collectives above stay inside the slice, and what crosses slices is
a host transfer to the data-center network's runtime (a `send` carrying
`_xla_megascale_transfer_type`). `across_slices` counts those per chip per step (each
send's operand, by transfer type, loop trips applied), the bytes a chip sends for them
on a ring of S slices (an all-reduce 2 (S-1)/S of its operand, a reduce-scatter or
all-to-all (S-1)/S, an all-gather S-1 times its piece, a one-to-one its operand), the
floor (each chip's gradient share all-reduced once: `plan.gradient_share_bytes`, sent
as an all-reduce sends it), `planned` (what `plan.across_slices` says the step sends),
and `in_loops`, the bytes of transfers inside any loop (the micro-batch loop's among
them), which must be 0.
"""

from __future__ import annotations

import collections
import math
import os
import re

import jax
import numpy as np
from absl import flags

from benchmarks import common
from benchmarks.dots import HLO_CALLS
from benchmarks.dots import hlo_runs
from bov_jax import cli
from bov_jax.run import plan
from bov_jax.settings import config as config_lib
from bov_jax.training import aot

_RUNS = flags.DEFINE_list("runs", ["bov_780m:v5p-64", "baseline_780m:v5p-64"],
                          "CONFIG:TOPOLOGY pairs (configs/CONFIG.py).")
_PROGRAMS = flags.DEFINE_list("programs", ["train", "decode"], "What to compile.")
_HLO_DIR = flags.DEFINE_string("hlo_dir", None, "Also write each compiled train step's HLO "
                               "here (CONFIG-TOPOLOGY.hlo.txt), to read its collectives again.")
_OVERRIDES = flags.DEFINE_multi_string("set", [], "KEY=VALUE config overrides for every run "
                                       "(model.remat=full, mesh.fsdp=-1, ...).")

_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "pred": 1, "s8": 1, "u8": 1}
_SHAPE = re.compile(r"\b(f32|bf16|s32|u32|f16|pred|s8|u8)\[([\d,]*)\]")
_KINDS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
          "all-reduce": "all_reduce", "all-to-all": "all_to_all",
          "collective-permute": "collective_permute"}


def _bytes(text: str) -> int:
  return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in _SHAPE.findall(text))


def collectives(hlo_text: str) -> dict:
  """{kind: bytes per chip per run of the module}: an all-gather counts its result, the
  others their operands (for the async `-start` forms, the operand half of the tuple).
  The TPU compiler runs a large collective in steps, each fused with other work
  (`async_collective_fusion`s that carry the whole result buffer, the collective's
  channel id and its `chain_id`): one chain is one collective, counted once."""
  comps, runs = hlo_runs(hlo_text)
  out = collections.Counter()
  seen = set()
  for comp, lines in comps.items():
    for line in lines:
      m = re.search(r"= (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all|"
                    r"collective-permute)(-start)?\(", line)
      if not m or not runs[comp]:
        continue
      chain = re.search(r'channel_id=(\d+).*chain_id="(\d+)"', line)
      if chain and chain.groups() in seen:
        continue
      seen.add(chain and chain.groups())
      result, kind, start = m.groups()
      shapes = [(t, d) for t, d in _SHAPE.findall(result) if d]  # u32[] are sync flags
      scale = 1
      if start and len(shapes) > 1:  # an async start's (operands, results) tuple
        half = len(shapes) // 2
        shapes = shapes[half:] if kind == "all-gather" else shapes[:half]
      elif kind == "reduce-scatter":  # its result: the operand over the group
        scale = group_size(line)
      out[_KINDS[kind]] += (_bytes(" ".join(f"{t}[{d}]" for t, d in shapes)) * scale
                            * runs[comp])
  return dict(out)


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


def loop_computations(comps: dict) -> set:
  """The computations a while loop runs (its body, and what that calls, transitively)."""
  inside = set()
  todo = [n.strip().lstrip("%") for lines in comps.values() for line in lines
          for kind, names in HLO_CALLS.findall(line) if kind == "body"
          for n in names.split(",")]
  while todo:
    name = todo.pop()
    if name in inside or name not in comps:
      continue
    inside.add(name)
    todo += [n.strip().lstrip("%") for line in comps[name]
             for _, names in HLO_CALLS.findall(line) for n in names.split(",")]
  return inside


# The bytes a chip sends on a ring of s slices for a transfer of each type, per operand byte.
_SENT = {"all_reduce": lambda s: 2 * (s - 1) / s, "reduce_scatter": lambda s: (s - 1) / s,
         "all_to_all": lambda s: (s - 1) / s, "all_gather": lambda s: s - 1,
         "one_to_one": lambda s: 1}


def across_slices(hlo_text: str, slices: int) -> dict:
  """What one slice's compiled program sends to the other slices per chip per run:
  {transfer type: bytes} (each send's operand, counted as often as the module runs it),
  `sent` (the bytes a chip sends for them, `_SENT`) and `in_loops`, the operand bytes
  sent from inside a loop."""
  comps, runs = hlo_runs(hlo_text)
  loops = loop_computations(comps)
  out, in_loops = collections.Counter(), 0
  for comp, lines in comps.items():
    for line in lines:
      kind = _MEGASCALE.search(line)
      if not kind or not re.search(r"= \(.*?\) send\(", line) or not runs[comp]:
        continue
      first = _SHAPE.search(line.split(" send(")[0])  # the tuple's first: the operand
      n = _bytes(first.group(0)) * runs[comp]
      out[kind.group(1).lower()] += n
      in_loops += n if comp in loops else 0
  sent = sum(n * _SENT[kind](slices) for kind, n in out.items())
  return {"bytes": dict(out), "sent": int(sent), "in_loops": in_loops}


def group_size(line: str) -> int:
  """The devices in each of a collective's replica groups, as the compiled HLO writes
  them: `{{0,1,...},...}`, `[groups,size]<=[n]` or `mesh['data'=8,...] {'data'}`."""
  m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[\d+,(\d+)\]<=", line)
  if m:
    return int(m.group(1))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
  raise ValueError(f"replica groups not understood: {line[:200]}")


def floor(spec, report) -> dict:
  """What one step must move at the least, counted as `collectives` counts (an
  all-gather's result, the others' operand, per chip). With FSDP, every block and head
  weight gathered whole for the forward and again for the backward of each micro-batch,
  and its gradient reduce-scattered after each (in the compute dtype; value tables
  excluded: they are never gathered). Over data replicas, each chip's share of the
  gradients (tables included, stored dtypes) reduced once: where the update is split
  (optim.shard_optimizer), reduce-scattered into the optimizer's shards and the new
  parameters all-gathered (Muon's matrices as their updates, in
  optim.muon_update_dtype), else all-reduced."""
  from flax import nnx

  from bov_jax.model import gpt as model_lib
  from bov_jax.optim import optimizer as optim
  fsdp, data = report["mesh"]["fsdp"], report["mesh"]["data"]
  flat = [(tuple(str(k) for k in path), v) for path, v in nnx.to_flat_state(
      nnx.state(model_lib.abstract(spec.model)))]
  weights = sum(math.prod(v.shape) for path, v in flat if path[0] != "tables")
  stored = sum(math.prod(v.shape) * v.dtype.itemsize for _, v in flat)
  update = np.dtype(spec.optim.update_dtype).itemsize
  gathered = sum(math.prod(v.shape) * (update if optim.label(path) == "muon" else
                                       v.dtype.itemsize) for path, v in flat)
  dt = 2 if spec.model.dtype == "bfloat16" else 4
  accum = report["spec"].get("accum", 1)
  out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
  if fsdp > 1:
    out.update(all_gather=2 * accum * weights * dt, reduce_scatter=accum * weights * dt)
  if data > 1 and spec.optim.shard_optimizer:
    out["reduce_scatter"] += stored // fsdp
    out["all_gather"] += gathered // fsdp
  elif data > 1:
    out["all_reduce"] = stored // fsdp
  return out


# What the floor counts: gathers and reductions, the TPU compiler's collective permutes
# among them (the rings of its windowed matmuls, which gather FSDP's weights and
# reduce-scatter their gradients); an all-to-all moves rows of a value table instead.
GATHERED_REDUCED = ("all_gather", "reduce_scatter", "all_reduce", "collective_permute")


def optimizer_flops(compiled_update) -> float:
  """FLOPs per chip of the compiled optimizer update (the compiler's cost analysis,
  which counts a loop's body once: an update that loops is refused, not undercounted)."""
  comps, runs = hlo_runs(compiled_update.as_text())
  if any(n > 1 for n in runs.values()):
    raise ValueError("the optimizer update runs a loop: its cost analysis would count "
                     "the body once")
  return float(compiled_update.cost_analysis()["flops"])


def run_one(name: str, topology: str) -> dict:
  cfg = config_lib.from_file(f"configs/{name}.py")
  for item in _OVERRIDES.value:
    key, value = item.split("=", 1)
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    old = node[leaf]
    node[leaf] = value == "true" if isinstance(old, bool) else type(old)(value)
  spec = aot.spec_for(cfg, topology)  # resolved for the slice's chips, as --mode=compile does
  kept = {}
  programs = _PROGRAMS.value + (["update"] if "train" in _PROGRAMS.value else [])
  report = aot.run(spec, topology, programs, log=lambda *_: None,
                   on_compiled=lambda n, c: kept.__setitem__(n, c))
  record = {"config": name, "topology": report["topology"], "fits": report["fits"],
            "mesh": report["mesh"], "hbm_gib": round(report["hbm_bytes_per_chip"] / aot.GiB, 2)}
  for prog, fig in report["programs"].items():
    if prog in ("prefill", "update_step"):  # the update's figure is its FLOPs, below
      continue
    record[prog] = {k: fig.get(k) for k in ("peak_bytes", "compile_s", "max_batch",
                                            "cache_bytes_per_sequence") if k in fig}
  if "train_step" in kept and _HLO_DIR.value:
    os.makedirs(_HLO_DIR.value, exist_ok=True)
    with open(os.path.join(_HLO_DIR.value, f"{name}-{topology}.hlo.txt"), "w") as f:
      f.write(kept["train_step"].as_text())
  if "train_step" in kept:
    train = record["train_step"]
    train["collectives"] = collectives(kept["train_step"].as_text())
    train["floor"] = floor(spec, report)
    least = sum(train["floor"].values())
    moved = sum(train["collectives"].get(k, 0) for k in GATHERED_REDUCED)
    train["gathered_reduced_vs_floor"] = round(moved / least, 3) if least else None
    train["all_vs_floor"] = (round(sum(train["collectives"].values()) / least, 3) if least
                             else None)
    train["optimizer_flops_per_chip"] = optimizer_flops(kept["update_step"])
    train["model_flops_per_chip"] = (plan.flops_per_token(spec.model) * spec.train.batch_tokens
                                     / report["chips"])
    train["optimizer_share"] = round(train["optimizer_flops_per_chip"]
                                     / train["model_flops_per_chip"], 4)
    if report["slices"] > 1:
      cross = across_slices(kept["train_step"].as_text(), report["slices"])
      planned = plan.across_slices(spec, report["peak_flops"])
      least = planned["floor_bytes_per_chip"]
      cross.update(floor=least, vs_floor=round(cross["sent"] / least, 3),
                   planned=planned["sent_bytes_per_chip"],
                   **{k: v for k, v in planned.items()
                      if k in ("dcn_gbps_per_chip", "dcn_seconds", "compute_seconds_at_peak",
                               "dcn_vs_compute")})
      train["across_slices"] = cross
  return record


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)
  for item in _RUNS.value:
    name, topology = item.split(":")
    common.emit(run_one(name, topology))


if __name__ == "__main__":
  cli.run(main)  # a missing extra: one line, exit 1
