"""Entry point: `python -m bov_jax.main --config=FILE [--workdir=DIR] [--mode=MODE]`.

Flags only: the modes are jobs/modes.py's (training is training/train.py's).
A run directory is the source of truth: given one that holds a run, `--config` may be
left out (the run's config.json is read, and `--config.*` overrides apply to it).
"""

from __future__ import annotations

import gc
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from bov_jax import cli
from bov_jax.host import hugepages
from bov_jax.settings import config as config_lib
from bov_jax.store import rundir

MODES = ("train", "plan", "eval", "sample", "compile")

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "settings", "config.py"),
    "ml_collections config file (optional with a --workdir that holds a run).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, tokenizer).")
_MODE = flags.DEFINE_enum("mode", "train", MODES, "What to do.")
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "--mode=compile (and --mode=plan, optional): the TPU slice, as "
    "gcloud's accelerator types (v5p-64, v5e-16 or v5litepod-16, v6e-8, v4-32, ...); "
    "several slices as 2xv5p-64 or with --config.mesh.slices=2.")
_DCN_GBPS = flags.DEFINE_float(
    "dcn_gbps", 25.0, "--mode=plan over several slices: the data-center network's "
    "bandwidth a chip, Gbit/s (25: a v5e host's 2 x 100 Gbit/s over its 8 chips).")
_PROGRAMS = flags.DEFINE_list(
    "programs", ["train", "eval", "decode"], "--mode=compile: which programs to compile.")
_DISTRIBUTED = cli.Distributed()


def _override_keys(argv) -> list[str]:
  """The settings given as --config.KEY=VALUE (or --config.KEY VALUE) on the command line."""
  return [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]


def config_for(mode: str, workdir: str | None, parsed, given: bool, argv):
  """The config a mode runs: --config's file with its overrides, or, without --config,
  the run directory's config.json with the command line's overrides applied to it."""
  if given:
    return parsed
  saved = rundir.read_config(workdir) if workdir else None
  if saved is None:
    where = f"--workdir={workdir} holds no config.json" if workdir else "no --workdir was given"
    raise app.UsageError(f"--config=FILE is required ({where}); for example "
                         "--config=configs/tiny.py")
  for key in _override_keys(argv):
    config_lib.assign(saved, key, config_lib.flatten(parsed)[key])
  return saved


def run_mode(mode: str, cfg, workdir: str | None) -> int:
  """Runs a mode (jobs/modes.py); returns the exit code: 0 done, 2 bad input, 1 the run
  failed (or, for --mode=compile, a program does not fit), 75 stopped by a preemption,
  checkpointed: run it again."""
  from bov_jax.jobs import modes  # after JAX's set-up here (huge pages, distributed runtime)
  # What the imports made lives as long as the process: out of the collector's reach, each
  # full collection walks only what the run makes (docs/performance.md: the collector).
  gc.freeze()
  try:
    return modes.run(mode, cfg, workdir, _TOPOLOGY.value, _PROGRAMS.value, _DCN_GBPS.value)
  except (ValueError, OSError) as e:  # config, data, run-directory, bundle errors (2), or
    return cli.failed(e)              # a disk, bucket or device that failed (1)
  except modes.RUN_FAILED as e:
    print(f"error: {e}", file=sys.stderr)  # the run failed, or cannot run here
    return cli.FAILED


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = config_for(_MODE.value, _WORKDIR.value, _CONFIG.value, _CONFIG.present, sys.argv)
  except ValueError as e:  # the run directory is not one (a file, say)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if _MODE.value not in ("plan", "compile"):
    _DISTRIBUTED.start()
  sys.exit(run_mode(_MODE.value, cfg, _WORKDIR.value))


if __name__ == "__main__":
  hugepages.reexec_with_huge_pages()  # before jax starts, CPU runs only: see hugepages.py
  cli.run(main)
