"""Command: a checkpoint of the reference PyTorch code as a bov_jax run directory
(interop/nanochat.py maps the parameters).

  python -m bov_jax.convert --checkpoint=model_000500.pt --meta=meta_000500.json \
      --tokenizer=TOKENIZER_DIR --workdir=DIR [--model_type=NAME] [--step=N]

Prints {"checkpoint": PATH} as one JSON line. Scripts call `bov_jax.interop.nanochat`.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.interop import nanochat


def _define_flags():
  """The flags, defined when this runs as the command."""
  flags.DEFINE_string("checkpoint", None, "reference model_*.pt (or .npz)")
  flags.DEFINE_string("meta", None, "reference meta_*.json")
  flags.DEFINE_string("workdir", None, "bov_jax run directory to write")
  flags.DEFINE_string("tokenizer", None, "the reference's tokenizer directory (tokenizer.pkl); "
                      "without it the run directory has no tokenizer until one is given")
  flags.DEFINE_string("model_type", None, "reference variant, if meta lacks it")
  flags.DEFINE_integer("step", None, "checkpoint step (default: from the file name)")


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  for name in ("checkpoint", "meta", "workdir"):
    if f[name].value is None:
      raise app.UsageError(f"--{name} is required")
  try:
    path = nanochat.convert_file(f.checkpoint, f.meta, f.workdir, f.model_type, f.step,
                                 f.tokenizer)
  except (ValueError, OSError) as e:  # bad input (2), or it failed (1)
    return cli.failed(e)
  print(json.dumps({"checkpoint": path}))
  return 0


if __name__ == "__main__":
  _define_flags()
  cli.run(lambda argv: sys.exit(main(argv)))
