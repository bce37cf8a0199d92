"""Experiment grids: one sweep file, one `python -m bov_jax.main` command per point.

A sweep file (configs/sweeps/NAME.py) defines `get_sweep()` returning

  {"base": "configs/bov_135m.py",           # the config every point starts from
   "points": [{"name": "bov", "overrides": {"model.value.preset": "..."}}, ...]}

`product(...)` builds points from axes when a grid reads better as one. Every
point keeps the base's FLOP budget (train.target_flops): each variant trains for
as many steps as its own FLOPs per token allow, as in the paper.

The command `python -m bov_jax.sweep` prints the points' commands or runs them here
(`run_local`).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shlex
import socket
import subprocess
import sys
import time
from typing import NamedTuple

from bov_jax.store import rundir
from bov_jax.store import storage

BUDGET_KEYS = ("train.target_flops", "train.num_iterations")


class SweepError(ValueError):
  pass


def point(name: str, **overrides) -> dict:
  """A named point; keyword `model__value__preset` stands for `model.value.preset`."""
  return {"name": name, "overrides": {k.replace("__", "."): v for k, v in overrides.items()}}


def from_presets(base: str, rows, numbered: bool = False) -> dict:
  """A sweep with one point per (name, model.value.preset) row."""
  return {"base": base,
          "points": [{"name": f"{i + 1:02d}_{name}" if numbered else name,
                      "overrides": {"model.value.preset": preset}}
                     for i, (name, preset) in enumerate(rows)]}


def product(*axes) -> list[dict]:
  """Points from axes, each a list of (name, overrides) pairs: their Cartesian product."""
  out = []
  for combo in itertools.product(*axes):
    name = "-".join(n for n, _ in combo)
    overrides = {}
    for _, o in combo:
      overrides.update(o)
    out.append({"name": name, "overrides": overrides})
  return out


def load(path: str) -> dict:
  if not os.path.exists(path):
    raise SweepError(f"--sweep={path}: no such file")
  spec = importlib.util.spec_from_file_location("bov_sweep", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise SweepError(f"--sweep={path} defines no get_sweep()")
  sweep = module.get_sweep()
  if "base" not in sweep or not sweep.get("points"):
    raise SweepError(f"--sweep={path}: get_sweep() must return {{'base': FILE, 'points': [...]}}")
  names = [p["name"] for p in sweep["points"]]
  if len(set(names)) != len(names):
    raise SweepError(f"--sweep={path}: point names repeat: {names}")
  for p in sweep["points"]:
    fixed = [k for k in p["overrides"] if k in BUDGET_KEYS]
    if fixed and not sweep.get("allow_budget_overrides"):
      raise SweepError(f"--sweep={path}: point {p['name']!r} overrides {fixed}; every point "
                       "keeps the base's FLOP budget")
  return sweep


def _flag(key, value) -> str:
  if isinstance(value, bool):
    value = str(value).lower()
  return f"--config.{key}={value}"


class Point(NamedTuple):
  name: str
  workdir: str
  argv: list[str]  # the command that trains it


def commands(sweep: dict, workdir_root: str, extra: list[str]) -> list[Point]:
  out = []
  for p in sweep["points"]:
    workdir = f"{workdir_root.rstrip('/')}/{p['name']}"
    argv = ["python", "-m", "bov_jax.main", f"--config={sweep['base']}", f"--workdir={workdir}"]
    argv += [_flag(k, v) for k, v in p["overrides"].items()] + list(extra)
    out.append(Point(p["name"], workdir, argv))
  return out


def train_point(argv: list[str], workdir: str, every_s: float = 30.0) -> int:
  """Trains a point (its command), echoing its output and adding it to the point's log
  (per host) every `every_s` seconds and at the end (a bucket workdir too), so a detached
  sweep's logs stay with its runs. Returns the exit code."""
  log = rundir.sweep_log(workdir, socket.gethostname())
  if not storage.is_remote(log):
    os.makedirs(workdir, exist_ok=True)
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  buf, last = [], time.monotonic()
  for line in proc.stdout:
    print(line, end="", flush=True)
    buf.append(line)
    if time.monotonic() - last > every_s:
      storage.append_text(log, "".join(buf))
      buf, last = [], time.monotonic()
  if buf:
    storage.append_text(log, "".join(buf))
  return proc.wait()


def run_local(cmds: list[Point]) -> int:
  """Trains the points here, in turn, skipping those finished; the first failure's exit
  code stops the sweep."""
  for point in cmds:
    if rundir.is_done(point.workdir):  # the train loop marks a run done after its last step
      print(f"[sweep] {point.name}: finished, skipping", flush=True)
      continue
    print(f"[sweep] {point.name}: {shlex.join(point.argv)}", flush=True)
    rc = train_point([sys.executable] + point.argv[1:], point.workdir)
    if rc != 0:
      print(f"[sweep] {point.name} failed with exit code {rc}", file=sys.stderr)
      return rc
  return 0
