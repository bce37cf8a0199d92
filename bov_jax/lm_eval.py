"""Command: EleutherAI's lm-evaluation-harness on a run directory or an exported folder
(evaluation/harness.py says what it computes).

  python -m bov_jax.lm_eval --workdir=DIR --tasks=hellaswag,arc_easy [--num_fewshot=N]
      [--limit=N] [--include_path=DIR] [--output=FILE] [--batch_size=32]
      [--max_gen_toks=256] [--seed=0] [--log_samples]
      [--coordinator_address=HOST:PORT --num_processes=N --process_id=I]

FILE (default DIR/lm_eval.json) gets lm-eval's results; stdout one summary JSON line.
Started on every process of a multi-process run (the distribution flags are main's), the
processes share the requests and process 0 alone writes FILE and prints.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.evaluation import harness
from bov_jax.host import process

_WORKDIR = flags.DEFINE_string("workdir", None,
                               "a run directory or an exported folder (export.py)")
_TASKS = flags.DEFINE_list("tasks", None, "lm-eval task names (comma-separated)")
_FEWSHOT = flags.DEFINE_integer("num_fewshot", None,
                                "examples in front of each request (lm-eval's)")
_LIMIT = flags.DEFINE_float("limit", None, "items per task (below 1: a fraction; lm-eval's)")
_INCLUDE = flags.DEFINE_string("include_path", None,
                               "a folder of task YAMLs besides lm-eval's own")
_OUTPUT = flags.DEFINE_string("output", None, "the results JSON (default: WORKDIR/lm_eval.json)")
_BATCH = flags.DEFINE_integer("batch_size", 32, "rows scored or generated at once")
_MAX_GEN = flags.DEFINE_integer("max_gen_toks", 256, "generate_until's default token budget")
_SEED = flags.DEFINE_integer("seed", 0, "lm-eval's seeds (few-shot sampling) and the sampling key")
_LOG_SAMPLES = flags.DEFINE_bool("log_samples", False, "FILE also gets every request and the "
                                 "model's responses (`samples`, as lm-eval's --log_samples)")
_DISTRIBUTED = cli.Distributed()


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir=DIR (a run directory or an exported folder) is required")
  try:
    _DISTRIBUTED.start()
    record = harness.evaluate(_WORKDIR.value, _TASKS.value or [], _FEWSHOT.value, _LIMIT.value,
                              _INCLUDE.value, _OUTPUT.value, _BATCH.value, _MAX_GEN.value,
                              _SEED.value, _LOG_SAMPLES.value,
                              log=lambda s: print(s, file=sys.stderr))
  except (ValueError, OSError) as e:  # bad input (2), or the environment failed (1)
    return cli.failed(e)
  if process.is_main():
    print(json.dumps(record), flush=True)
  return 0


if __name__ == "__main__":
  cli.run(lambda argv: sys.exit(main(argv)))
