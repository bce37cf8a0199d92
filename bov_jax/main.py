"""Entry point: `python -m bov_jax.main --config=FILE [--workdir=DIR] [--mode=MODE]`.

Flags and mode dispatch only; each mode lives in its own module.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

MODES = ("train", "plan", "eval", "sample")

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, tokenizer).")
_MODE = flags.DEFINE_enum("mode", "train", MODES, "What to do.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ("auto", "true", "false"),
    "Call jax.distributed.initialize() (auto: on multi-host TPU pods and when "
    "JAX_COORDINATOR_ADDRESS is set).")


def _multi_host_env() -> bool:
  import os
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return "," in hosts or bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))


def _print_json(obj) -> None:
  print(json.dumps(obj), flush=True)


def run(mode: str, cfg, workdir: str | None) -> int:
  from bov_jax import config as config_lib
  try:
    config_lib.validate(cfg)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if mode == "plan":
    from bov_jax import plan
    _print_json(plan.make_plan(cfg))
    return 0
  from bov_jax import train
  try:
    if mode == "train":
      train.train(cfg, workdir)
      return 0
    if mode == "eval":
      _print_json(train.evaluate_checkpoint(cfg, workdir))
      return 0
    if mode == "sample":
      _print_json(train.sample_checkpoint(cfg, workdir))
      return 0
  except (ValueError, FileNotFoundError, train.TrainError) as e:  # incl. BundleError
    print(f"error: {e}", file=sys.stderr)
    return 1 if isinstance(e, train.TrainError) else 2
  raise AssertionError(mode)  # absl restricts --mode to MODES


def main(argv):
  # orbax and grain log every file operation at INFO; keep the console to our progress lines
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config=FILE is required (for example configs/tiny.py)")
  if _MODE.value != "plan" and (_DISTRIBUTED.value == "true" or
                                (_DISTRIBUTED.value == "auto" and _multi_host_env())):
    import jax
    jax.distributed.initialize()
  if _MODE.value != "plan":
    from bov_jax import train
    train.use_compile_cache(_CONFIG.value)
  sys.exit(run(_MODE.value, _CONFIG.value, _WORKDIR.value))


if __name__ == "__main__":
  from bov_jax import hostmem
  hostmem.reexec_with_huge_pages()  # before jax starts: see hostmem.py
  app.run(main)
