"""Run directories and orbax checkpoints.

Layout of a workdir (local or gs://):
  config.json            the run's config: a resume compares the config it is asked for
                         with this one (refusing changes it cannot restore) and
                         rewrites it with the changes it takes
  config_changes.jsonl   one line per resume that changed a setting
  checkpoints/<step>/    orbax CheckpointManager steps; items `params` (parameters),
                         `opt` (optimizer state), `data` (iterator state), `meta`
  tokenizer.json, metrics.jsonl, events.out.tfevents.* (TensorBoard), DONE

Orbax writes each step to a temporary directory and renames it when complete,
so a killed run never leaves a half-written checkpoint that looks finished.
"""

from __future__ import annotations

import json
import os
import time
from typing import NamedTuple

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from bov_jax import config as config_lib


class RunDirError(ValueError):
  """A workdir that cannot hold, or resume, the requested run."""


class CorruptCheckpointError(RuntimeError):
  """Checkpoints exist but none of them reads back."""


def path(workdir: str) -> epath.Path:
  """The workdir as a path (absolute when local); an existing file is refused."""
  p = epath.Path(workdir if "://" in workdir else os.path.abspath(workdir))
  if p.exists() and not p.is_dir():
    raise RunDirError(f"--workdir={workdir} is a file; expected a directory (new or a run's)")
  return p


def checkpoint_dir(workdir: str) -> str:
  return str(path(workdir) / "checkpoints")


# -- the config of record -------------------------------------------------------------

def read_config(workdir: str) -> ml_collections.ConfigDict | None:
  """The workdir's config.json over the schema's defaults (so a config written before
  a setting existed still reads), or None when there is none."""
  p = path(workdir) / "config.json"
  if not p.exists():
    return None
  cfg = config_lib.base_config()
  for key, value in config_lib.flatten(json.loads(p.read_text())).items():
    *parents, name = key.split(".")
    node = cfg
    for part in parents:
      node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if isinstance(node, ml_collections.ConfigDict) and name in node:
      with node.ignore_type():
        node[name] = value
  return cfg


def write_config(workdir: str, cfg) -> None:
  d = path(workdir)
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(cfg.to_json(indent=2))


def check_config(workdir: str, cfg) -> dict | None:
  """The settings `cfg` changes against the workdir's config of record ({name: (old, new)};
  None for a new workdir). Once the workdir holds a checkpoint, a change it cannot restore
  (config.FIXED_ON_RESUME) is refused, naming each setting and both values. Every process
  checks; only process 0 records (record_config)."""
  old = read_config(workdir)
  if old is None:
    return None
  delta = config_lib.changes(old, cfg)
  fixed = config_lib.fixed_changes(delta)
  if fixed and saved_steps(workdir):
    lines = "\n".join(f"  {k}: the run has {a!r}, asked for {b!r}" for k, (a, b) in fixed.items())
    raise RunDirError(
        f"--workdir={workdir} holds a run whose checkpoints cannot restore into the requested "
        f"config; these settings differ:\n{lines}\nUse a new --workdir, or leave them as the "
        "run has them (--mode=eval and --mode=sample need no --config: they read the run's)")
  return delta


def record_config(workdir: str, cfg, delta: dict | None, log=print) -> None:
  """Makes `cfg` the workdir's config of record: a new workdir takes it as is; a resume
  that changed settings (`delta`, from check_config) logs them and appends them to
  config_changes.jsonl."""
  if delta is None:
    write_config(workdir, cfg)
  elif delta:
    log("resuming with changed settings: "
        + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in delta.items()))
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "after_step": max(saved_steps(workdir), default=None),
              "changes": {k: [a, b] for k, (a, b) in delta.items()}}
    changes = path(workdir) / "config_changes.jsonl"
    before = changes.read_text() if changes.exists() else ""
    changes.write_text(before + json.dumps(record) + "\n")
    write_config(workdir, cfg)


def adopt_config(workdir: str, cfg, log=print) -> None:
  """check_config, then record_config: one process's whole step."""
  record_config(workdir, cfg, check_config(workdir, cfg), log)


# -- orbax ------------------------------------------------------------------------------

def saved_steps(workdir: str) -> list[int]:
  """The steps checkpointed in a workdir, from its listing alone (no orbax manager: making
  one is a collective every process must join)."""
  d = path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


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
    self.mgr = ocp.CheckpointManager(checkpoint_dir(workdir), options=options)

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

  def restore(self, params, opt_state=None, data_iter=None, log=print) -> Restored | None:
    """The newest readable checkpoint, or None when there is none. `params` and
    `opt_state` give the shapes and shardings to restore into (arrays or abstract);
    `data_iter` is restored in place where the checkpoint holds its state for this
    process count (`data_restored`; a run resumed on another number of processes starts
    its data afresh)."""
    items = {"params": ocp.args.StandardRestore(_abstract(params))}
    if opt_state is not None:
      items["opt"] = ocp.args.StandardRestore(_abstract(opt_state))
    for step in reversed(self.all_steps()):
      try:
        out = self.mgr.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # noqa: BLE001 - any unreadable step: fall back, loudly
        log(f"warning: checkpoint {checkpoint_dir(self.workdir)}/{step} is unreadable "
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
        mine = (f"process_{jax.process_index()}-of-{jax.process_count()}.json")
        if (path(self.workdir) / "checkpoints" / str(step) / "data" / mine).exists():
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
          f"no checkpoint under {checkpoint_dir(self.workdir)} could be read "
          f"(steps {self.all_steps()})")
    return None

  def close(self):
    self.mgr.wait_until_finished()
    self.mgr.close()


def save_params(workdir: str, cfg, params, step: int) -> str:
  """A parameters-only checkpoint and the config (checkpoint import)."""
  write_config(workdir, cfg)
  ckpts = Checkpoints(workdir, async_save=False)
  ckpts.save(step, params, meta={"step": step}, force=True)
  ckpts.close()
  return f"{checkpoint_dir(workdir)}/{step}"
