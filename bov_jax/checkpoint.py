"""Run directories and orbax checkpoints.

Layout of a workdir:
  config.json            the run's full config (written once; a resume checks it)
  checkpoints/<step>/    orbax CheckpointManager steps; items `model` (parameters),
                         `opt` (optimizer state), `data` (iterator state, JSON)
  metrics.jsonl, tokenizer.json

Orbax writes each step to a temporary directory and renames it when complete,
so a killed run never leaves a half-written checkpoint that looks finished.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir) if "://" not in workdir else workdir,
                      "checkpoints")


def write_config(workdir: str, cfg) -> None:
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json(indent=2))


def read_config(workdir: str):
  import ml_collections
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"--workdir={workdir} holds no config.json (not a bov_jax run)")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def manager(workdir: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


def pure(state):
  """An nnx.State as a plain nested dict of arrays (what orbax stores)."""
  return nnx.to_pure_dict(state)


def save_converted(workdir: str, cfg, model, step: int) -> str:
  """Writes a model-only checkpoint (checkpoint import) and the config."""
  write_config(workdir, cfg)
  mgr = manager(workdir, async_save=False)
  mgr.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(pure(nnx.state(model)))),
           force=True)
  mgr.wait_until_finished()
  mgr.close()
  return os.path.join(checkpoint_dir(workdir), str(step))


def restore_model(workdir: str, model, step: int | None = None) -> int:
  """Loads the `model` item of a checkpoint into `model` in place; returns the step."""
  mgr = manager(workdir, async_save=False)
  step = mgr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {checkpoint_dir(workdir)}")
  state = nnx.state(model)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, pure(state))
  restored = mgr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract)))
  nnx.replace_by_pure_dict(state, restored["model"])
  nnx.update(model, state)
  mgr.close()
  return step
