"""Command: the paper's corpus, ClimbMix, fetched into a directory (data/corpus.py).

  python -m bov_jax.corpus download --shards=N --dir=DIR [--dry_run]
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.data import corpus

_SHARDS = flags.DEFINE_integer("shards", 8, "training shards of ClimbMix (the validation "
                               "shard is added)")
_DIR = flags.DEFINE_string("dir", "~/.cache/bov_jax/climbmix", "where the shards go (a local "
                           "directory)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print what would be fetched, fetch nothing")


def main(argv) -> int:
  if len(argv) != 2 or argv[1] != "download":
    raise app.UsageError("usage: python -m bov_jax.corpus download --shards=N --dir=DIR "
                         "[--dry_run]")
  try:
    names = corpus.download(_SHARDS.value, _DIR.value, dry_run=_DRY_RUN.value)
  except (ValueError, OSError) as e:  # bad input (2), or the network failed (1)
    return cli.failed(e)
  for n in names:
    print(f"{'would fetch' if _DRY_RUN.value else 'fetched'} {corpus.CLIMBMIX_REPO}/{n} -> "
          f"{os.path.expanduser(_DIR.value)}")
  print(json.dumps({"dir": _DIR.value, "fetched" if not _DRY_RUN.value else "would_fetch": names}))
  return 0


if __name__ == "__main__":
  cli.run(lambda argv: sys.exit(main(argv)))
