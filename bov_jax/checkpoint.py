"""Orbax checkpoints of a run: save and restore (the run directory's layout is rundir.py's).

Each checkpoint step holds the items `params` (parameters), `opt` (optimizer state),
`data` (each process's data-iterator state) and `meta`. Orbax writes each step to a
temporary directory and renames it when complete, so a killed run never leaves a
half-written checkpoint that looks finished.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import orbax.checkpoint as ocp

from bov_jax import rundir


class CorruptCheckpointError(RuntimeError):
  """Checkpoints exist but none of them reads back."""


def _abstract(tree):
  """What orbax restores into: shapes, dtypes and shardings (a single device where an
  abstract leaf has none)."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def leaf(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or device)
  return jax.tree.map(leaf, tree)


class Restored(NamedTuple):
  step: int
  params: object
  opt_state: object
  meta: dict
  data_restored: bool = False


class Checkpoints:
  """A workdir's checkpoints: parameters, optimizer state, data iterator, metadata.

  Saves are asynchronous (training continues while orbax writes). `restore` is the
  one way back, for training (everything) and for evaluation (parameters only): the
  newest checkpoint that reads back, falling back past any that is corrupt, saying
  which it skipped.
  """

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
    self.workdir = workdir
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.mgr = ocp.CheckpointManager(rundir.checkpoints(workdir), options=options)

  def latest_step(self):
    return self.mgr.latest_step()

  def all_steps(self):
    return sorted(self.mgr.all_steps())

  def save(self, step: int, params, opt_state=None, data_iter=None, meta: dict | None = None,
           force: bool = False):
    items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta or {})}
    if opt_state is not None:
      items["opt"] = ocp.args.StandardSave(opt_state)
    if data_iter is not None:
      import grain
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    return self.mgr.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, params, opt_state=None, data_iter=None, log=print,
              only: int | None = None) -> Restored | None:
    """The newest readable checkpoint (or exactly step `only`), or None when there is none.
    `params` and `opt_state` give the shapes and shardings to restore into (arrays or abstract);
    `data_iter` is restored in place where the checkpoint holds its state for this
    process count (`data_restored`; a run resumed on another number of processes starts
    its data afresh)."""
    items = {"params": ocp.args.StandardRestore(_abstract(params))}
    if opt_state is not None:
      items["opt"] = ocp.args.StandardRestore(_abstract(opt_state))
    if only is not None and only not in self.all_steps():
      raise FileNotFoundError(f"no checkpoint {only} under {rundir.checkpoints(self.workdir)} "
                              f"(steps {self.all_steps()})")
    for step in [only] if only is not None else reversed(self.all_steps()):
      try:
        out = self.mgr.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # noqa: BLE001 - any unreadable step: fall back, loudly
        log(f"warning: checkpoint {rundir.checkpoints(self.workdir)}/{step} is unreadable "
            f"({type(e).__name__}: {str(e)[:200]}); trying the previous one")
        continue
      meta = {}
      try:
        meta = self.mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      except Exception:  # noqa: BLE001 - a converted checkpoint may carry no metadata
        pass
      data_restored = False
      if data_iter is not None:
        import grain
        if rundir.checkpoint_data(self.workdir, step, jax.process_index(),
                                  jax.process_count()).exists():
          self.mgr.restore(step, args=ocp.args.Composite(
              data=grain.checkpoint.CheckpointRestore(data_iter)))
          data_restored = True
        else:
          log(f"warning: checkpoint {step} holds no data-iterator state for "
              f"{jax.process_count()} process(es) (it was saved by another number); the "
              "data order starts afresh")
      return Restored(step, out["params"], out.get("opt") if opt_state is not None else None,
                      meta, data_restored)
    if self.all_steps():
      raise CorruptCheckpointError(
          f"no checkpoint under {rundir.checkpoints(self.workdir)} could be read "
          f"(steps {self.all_steps()})")
    return None

  def close(self):
    self.mgr.wait_until_finished()
    self.mgr.close()


def save_params(workdir: str, cfg, params, step: int) -> str:
  """A parameters-only checkpoint and the config (checkpoint import)."""
  rundir.write_config(workdir, cfg)
  ckpts = Checkpoints(workdir, async_save=False)
  ckpts.save(step, params, meta={"step": step}, force=True)
  ckpts.close()
  return f"{rundir.checkpoints(workdir)}/{step}"
