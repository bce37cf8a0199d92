"""Orbax checkpoints of a run: save and restore (the run directory's layout is rundir.py's).

Each checkpoint step holds the items `params` (parameters), `opt` (optimizer state),
`data` (each process's data-iterator state) and `meta`. Orbax writes each step to a
temporary directory and renames it when complete, so a killed run never leaves a
half-written checkpoint that looks finished.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import sys
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from bov_jax.store import rundir


class CorruptCheckpointError(RuntimeError):
  """Checkpoints exist but none of them reads back."""


def _abstract(tree):
  """What orbax restores into: shapes, dtypes and shardings (a single device where an
  abstract leaf has none)."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def leaf(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or device)
  return jax.tree.map(leaf, tree)


def _check_room(directory: str, step: int, tree) -> None:
  """A local disk without room for this process's part of a step fails here, in one
  error, rather than in orbax's writer threads (a traceback for each, then a partial
  step). Buckets have no free space to ask about."""
  if "://" in directory:
    return
  need = sum(s.data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
             for s in x.addressable_shards if s.replica_id == 0)
  probe = directory
  while not os.path.exists(probe):
    probe = os.path.dirname(probe) or "."
  free = shutil.disk_usage(probe).free
  if free < need:
    raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {step}: it needs "
                  f"{need / 2**20:,.1f} MiB, {directory} has {free / 2**20:,.1f} MiB free")


class _FailedReadReports:
  """A step that does not read back leaves, from orbax's readers, a traceback per array
  as their tasks and coroutines are collected (asyncio's 'exception was never
  retrieved', 'coroutine ignored') and as tensorstore's reads end after orbax closed
  their event loop ('Event loop is closed', from tensorstore's threads, later); the one
  warning line that sets the step aside says it all. From a failed read until the
  checkpoints are closed, those reports (and only those) are dropped; then the
  process's own hooks come back."""

  def __init__(self):
    self.previous = sys.unraisablehook, sys.excepthook
    closed = lambda e: isinstance(e, RuntimeError) and str(e) == "Event loop is closed"  # noqa: E731

    def hook(unraisable):  # a reader's coroutine dropped, or its loop closed under it
      code = getattr(unraisable.object, "cr_code", None)
      if "orbax" not in getattr(code, "co_filename", "") and not closed(unraisable.exc_value):
        self.previous[0](unraisable)

    def except_hook(kind, value, tb):  # tensorstore's callbacks into the loop orbax closed
      if not closed(value):
        self.previous[1](kind, value, tb)

    self.filter = lambda r: not ("never retrieved" in r.getMessage() and any(
        w in r.getMessage() for w in ("orbax", "TensorStore", "OCDBT")))
    sys.unraisablehook, sys.excepthook = hook, except_hook
    logging.getLogger("asyncio").addFilter(self.filter)

  def remove(self) -> None:
    gc.collect()  # the failed read's leftovers reported (and dropped) now
    sys.unraisablehook, sys.excepthook = self.previous
    logging.getLogger("asyncio").removeFilter(self.filter)


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
  newest checkpoint that reads back whole, falling back past any that does not, saying
  which it skipped (and, resuming a run, setting it aside to be written again).
  """

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
    self.workdir = workdir
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.mgr = ocp.CheckpointManager(rundir.checkpoints(workdir), options=options)
    self._reports = None  # a failed read's leftover reports dropped until close()

  def latest_step(self):
    return self.mgr.latest_step()

  def all_steps(self):
    return sorted(self.mgr.all_steps())

  def save(self, step: int, params, opt_state=None, data_iter=None, meta: dict | None = None,
           force: bool = False):
    _check_room(rundir.checkpoints(self.workdir), step, (params, opt_state))
    items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta or {})}
    if opt_state is not None:
      items["opt"] = ocp.args.StandardSave(opt_state)
    if data_iter is not None:
      import grain
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    return self.mgr.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, params, opt_state=None, data_iter=None, log=print,
              only: int | None = None, set_aside: bool = False) -> Restored | None:
    """The newest checkpoint that reads back whole (or exactly step `only`), or None when
    there is none. `params` and `opt_state` give the shapes and shardings to restore into
    (arrays or abstract); `data_iter` is restored in place where the checkpoint holds its
    state for this process count (`data_restored`; a run resumed on another number of
    processes starts its data afresh). A step that does not read back whole is passed
    over, loudly; with `set_aside` (a training resume) it is renamed out of the way
    (`<step>.damaged`), so the run writes that step again when it reaches it. Every
    process reads; whether a step read back is agreed by all."""
    if only is not None and only not in self.all_steps():
      raise FileNotFoundError(f"no checkpoint {only} under {rundir.checkpoints(self.workdir)} "
                              f"(steps {self.all_steps()})")
    for step in [only] if only is not None else reversed(self.all_steps()):
      try:
        out = self._read(step, params, opt_state, data_iter, log)
        error = None
      except Exception as e:  # noqa: BLE001 - any unreadable step: fall back, loudly
        self._reports = self._reports or _FailedReadReports()
        while e.__cause__ is not None:  # the storage's own words, not orbax's wrapping
          e = e.__cause__
        out, error = None, f"{type(e).__name__}: {str(e)[:200]}"
      if not _all_agree(error is None):
        where = f"{rundir.checkpoints(self.workdir)}/{step}"
        why = error or "another process could not read its part"
        if set_aside:
          log(f"warning: checkpoint {where} does not read back whole ({why}); set aside as "
              f"{self._set_aside(step)}, trying the previous one")
        else:
          log(f"warning: checkpoint {where} is unreadable ({why}); trying the previous one")
        continue
      return out
    if self.all_steps():
      raise CorruptCheckpointError(
          f"no checkpoint under {rundir.checkpoints(self.workdir)} could be read "
          f"(steps {self.all_steps()})")
    return None

  def _read(self, step, params, opt_state, data_iter, log) -> Restored:
    """Step `step` whole: parameters, optimizer state, metadata and this process's data
    state (each where asked for); raises where any of them does not read back."""
    items = {"params": ocp.args.StandardRestore(_abstract(params))}
    if opt_state is not None:
      items["opt"] = ocp.args.StandardRestore(_abstract(opt_state))
    step_dir = epath.Path(rundir.checkpoints(self.workdir)) / str(step)
    if (step_dir / "meta").exists():  # a converted checkpoint may carry no metadata
      items["meta"] = ocp.args.JsonRestore()
    out = self.mgr.restore(step, args=ocp.args.Composite(**items))
    data_restored = False
    if data_iter is not None:
      n = jax.process_count()
      saved_by = (out.get("meta") or {}).get("processes")  # older steps: from their files
      if saved_by is None and (step_dir / "data").exists():
        saved_by = n if list((step_dir / "data").glob(f"process_*-of-{n}.json")) else 0
      if saved_by == n:  # this process's part is due: a missing or torn one is damage
        import grain
        self.mgr.restore(step, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(data_iter)))
        data_restored = True
      else:
        log(f"warning: checkpoint {step} holds no data-iterator state for "
            f"{jax.process_count()} process(es) (it was saved by another number); the "
            "data order starts afresh")
    return Restored(step, out["params"], out.get("opt") if opt_state is not None else None,
                    out.get("meta") or {}, data_restored)

  def _set_aside(self, step: int) -> str:
    """Renames a step out of orbax's sight (process 0, the others waiting) and has the
    manager forget it; returns the new name."""
    d = epath.Path(rundir.checkpoints(self.workdir))
    n = 0
    while (d / (name := f"{step}.damaged" + (f".{n}" if n else ""))).exists():
      n += 1
    if jax.process_index() == 0:
      (d / str(step)).rename(d / name)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"bov_jax: checkpoint {step} set aside")
    self.mgr.reload()
    return str(d / name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    self.mgr.wait_until_finished()
    self.mgr.close()
    if self._reports is not None:
      self._reports.remove()
      self._reports = None


def _all_agree(ok: bool) -> bool:
  """Whether every process says ok (one process: its own answer)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def save_params(workdir: str, cfg, params, step: int) -> str:
  """A parameters-only checkpoint and the config (checkpoint import)."""
  rundir.write_config(workdir, cfg)
  ckpts = Checkpoints(workdir, async_save=False)
  ckpts.save(step, params, meta={"step": step}, force=True)
  ckpts.close()
  return f"{rundir.checkpoints(workdir)}/{step}"
