"""Run directories and orbax checkpoints.

Layout of a workdir:
  config.json            the run's full config (written once; a resume checks it)
  checkpoints/<step>/    orbax CheckpointManager steps; items `params` (parameters),
                         `opt` (optimizer state), `data` (iterator state), `meta`
  metrics.jsonl, tokenizer.json

Orbax writes each step to a temporary directory and renames it when complete,
so a killed run never leaves a half-written checkpoint that looks finished.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir) if "://" not in workdir else workdir,
                      "checkpoints")


def write_config(workdir: str, cfg) -> None:
  d = epath.Path(workdir)
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(cfg.to_json(indent=2))


def read_config(workdir: str):
  import ml_collections
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"--workdir={workdir} holds no config.json (not a bov_jax run)")
  return ml_collections.ConfigDict(json.loads(path.read_text()))


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
  mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(pure(nnx.state(model)))),
           force=True)
  mgr.wait_until_finished()
  mgr.close()
  return os.path.join(checkpoint_dir(workdir), str(step))


def restore_model(workdir: str, model, step: int | None = None) -> int:
  """Loads the `params` item of a checkpoint into `model` in place; returns the step."""
  mgr = manager(workdir, async_save=False)
  step = mgr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {checkpoint_dir(workdir)}")
  state = nnx.state(model)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, pure(state))
  restored = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
  nnx.replace_by_pure_dict(state, restored["params"])
  nnx.update(model, state)
  mgr.close()
  return step


class CorruptCheckpointError(RuntimeError):
  pass


class TrainCheckpoints:
  """Train-state checkpoints: parameters, optimizer state, data iterator, metadata.

  Saves are asynchronous (training continues while orbax writes); a resume
  restores the newest checkpoint that reads back, falling back past any that
  is corrupt, and says which it skipped.
  """

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
    self.workdir = workdir
    self.mgr = manager(workdir, keep=keep, async_save=async_save)

  def latest_step(self):
    return self.mgr.latest_step()

  def all_steps(self):
    return sorted(self.mgr.all_steps())

  def save(self, step: int, params, opt_state, data_iter, meta: dict, force: bool = False):
    import grain
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt=ocp.args.StandardSave(opt_state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta))
    return self.mgr.save(step, args=args, force=force)

  def restore(self, abstract_params, abstract_opt, data_iter, log=print):
    """Restores the newest readable checkpoint into data_iter; returns
    (step, params, opt_state, meta) or None when there is none."""
    import grain
    for step in reversed(self.all_steps()):
      try:
        out = self.mgr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params),
            opt=ocp.args.StandardRestore(abstract_opt),
            data=grain.checkpoint.CheckpointRestore(data_iter),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - any unreadable step: fall back, loudly
        log(f"warning: checkpoint {checkpoint_dir(self.workdir)}/{step} is unreadable "
            f"({type(e).__name__}: {str(e)[:200]}); trying the previous one")
        continue
      return step, out["params"], out["opt"], out["meta"]
    if self.all_steps():
      raise CorruptCheckpointError(
          f"no checkpoint under {checkpoint_dir(self.workdir)} could be read "
          f"(steps {self.all_steps()})")
    return None

  def wait(self):
    self.mgr.wait_until_finished()

  def close(self):
    self.mgr.wait_until_finished()
    self.mgr.close()
