"""Command: from finished runs to the paper's tables and figures (jobs/report.py).

  python -m bov_jax.report RUN_DIR... --out=DIR     plots (PNG) and results.md
  python -m bov_jax.report RUN_DIR --coeffs         learned coefficients per layer (JSON)
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.jobs import report

_OUT = flags.DEFINE_string("out", None, "where to write PNGs and results.md")
_COEFFS = flags.DEFINE_bool("coeffs", False, "print learned coefficients as JSON")


def main(argv) -> int:
  """argv[1:]: run directories (workdirs)."""
  runs = argv[1:]
  if not runs:
    raise app.UsageError("give one or more run directories")
  if not _COEFFS.value and not _OUT.value:
    raise app.UsageError("--out=DIR is required (or --coeffs)")
  try:
    if _COEFFS.value:
      for d in runs:
        print(json.dumps({"run": d, **report.coefficients(d)}))
      return 0
    written = report.write([report.load_run(d) for d in runs], _OUT.value)
  except (ValueError, OSError) as e:  # bad input (2), or the environment failed (1)
    return cli.failed(e)
  print(json.dumps({"written": written}))
  return 0


if __name__ == "__main__":
  cli.run(lambda argv: sys.exit(main(argv)))
