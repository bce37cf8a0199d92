"""Command: an experiment grid (jobs/sweep.py), one `python -m bov_jax.main` per point.

  python -m bov_jax.sweep --sweep=FILE --print [--workdir_root=DIR] [--config.k=v ...]
  python -m bov_jax.sweep --sweep=FILE --local [--workdir_root=DIR]

Sweep files take `from_presets`, `product` and `point` from bov_jax.jobs.sweep.
"""

from __future__ import annotations

import json
import shlex
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.jobs import sweep as sweep_lib


def _define_flags():
  """The flags, defined when this runs as the command: sweep files import this module."""
  flags.DEFINE_string("sweep", None, "sweep file (configs/sweeps/NAME.py)")
  flags.DEFINE_string("workdir_root", "runs", "each point runs in WORKDIR_ROOT/NAME")
  flags.DEFINE_bool("print", False, "print one command per point")
  flags.DEFINE_bool("local", False, "run the points here, in turn")


def main(argv) -> int:
  """argv: what absl left unparsed, the --config.* overrides every point passes on."""
  f = flags.FLAGS
  extra = argv[1:]
  bad = [e for e in extra if not e.startswith("--config.")]
  if bad:
    raise app.UsageError(f"unexpected arguments {bad}: only --config.* overrides pass through")
  if f.sweep is None or f.print == f.local:
    raise app.UsageError("--sweep=FILE and one of --print or --local are required")
  try:
    sweep = sweep_lib.load(f.sweep)
  except sweep_lib.SweepError as e:
    return cli.failed(e)
  cmds = sweep_lib.commands(sweep, f.workdir_root, extra)
  if f.print:
    for c in cmds:
      print(shlex.join(c.argv))
    return 0
  rc = sweep_lib.run_local(cmds)
  if rc == 0:
    print(json.dumps({"sweep": f.sweep, "points": [p.name for p in cmds]}))
  return rc


if __name__ == "__main__":
  _define_flags()
  cli.run(lambda argv: sys.exit(main(argv)),
          flags_parser=lambda argv: flags.FLAGS(argv, known_only=True))
