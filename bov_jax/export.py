"""Command: a run's weights as a Hugging Face style folder (interop/export.py says what it holds).

  python -m bov_jax.export --workdir=DIR --out=DIR2 [--step=N] [--dtype=D]
                           [--max_shard_gib=5]

Prints {"out", "step", "files"} as one JSON line.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.interop import export as export_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "the run directory to export")
_OUT = flags.DEFINE_string("out", None, "the folder to write (local or gs://)")
_STEP = flags.DEFINE_integer("step", None, "the checkpoint step (default: the newest that reads)")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "cast floating tensors to this dtype (default: as the run stores them)")
_MAX_SHARD = flags.DEFINE_float("max_shard_gib", 5.0,
                                "above this, the weights are split into files")


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value or not _OUT.value:
    raise app.UsageError("--workdir=DIR and --out=DIR2 are required")
  try:
    result = export_lib.export(_WORKDIR.value, _OUT.value, _STEP.value, _DTYPE.value,
                               int(_MAX_SHARD.value * 2**30))
  except (ValueError, OSError) as e:  # bad input (2), or the environment failed (1)
    return cli.failed(e)
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  cli.run(lambda argv: sys.exit(main(argv)))
