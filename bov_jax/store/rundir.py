"""The run directory: every name in it, local or gs://, spelled here and nowhere else.

  config.json            the run's config of record: a resume compares the config it is
                         asked for with this one (refusing changes it cannot restore) and
                         rewrites it with the changes it takes
  config_changes.jsonl   one line per resume that changed a setting
  tokenizer/             the run's tokenizer (tokenizer.pkl, token_bytes.npy)
  checkpoints/<step>/    orbax steps (checkpoint.py): params, opt, data, meta
  metrics.jsonl          one record per logged step (metrics.py)
  events.out.tfevents.*  TensorBoard's event files (named by the writer itself)
  eval.json, core.json   the last --mode=eval result (validation bpb, CORE)
  lm_eval.json           the last `python -m bov_jax.lm_eval` result (lm-eval's JSON)
  profile/               a training run's trace (log.profile_steps; profiler.py)
  log.HOST.txt           a sweep point's console output, per host (sweep.py)
  DONE                   written after the last step: the last record (sweeps and
                         launch/tpu.sh's `watch` skip or stop on it)
  LOCK                   the training run that owns the directory now: its host, pid and
                         heartbeat (`Owner`); gone when it ends

Nothing is written here before the whole config has been checked (spec.resolve and
plan.batch_layout both raise before a mode opens its run directory).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import ml_collections
from etils import epath

from bov_jax.settings import config as config_lib

CONFIG = "config.json"
CONFIG_CHANGES = "config_changes.jsonl"
TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
EVAL = "eval.json"
CORE = "core.json"
LM_EVAL = "lm_eval.json"
DONE = "DONE"
LOCK = "LOCK"
PROFILE = "profile"

# An exported folder (export.py), as the Hugging Face hub holds a model. Its config.json
# is the model's (Hugging Face style); the run's whole config is run_config.json.
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_SHARD = "model-{:05d}-of-{:05d}.safetensors"
EXPORT_INDEX = "model.safetensors.index.json"
EXPORT_CONFIG = CONFIG
RUN_CONFIG = "run_config.json"
EXPORT_TOKENIZER = "tokenizer.json"  # the `tokenizers` library's file, beside tokenizer.pkl
EXPORT_TOKENIZER_CONFIG = "tokenizer_config.json"  # transformers' AutoTokenizer reads it
EXPORT_GENERATION = "generation_config.json"
MODEL_CARD = "README.md"


class RunDirError(ValueError):
  """A workdir that cannot hold, or resume, the requested run."""


def path(workdir: str) -> epath.Path:
  """The workdir as a path (absolute when local); an existing file is refused."""
  p = epath.Path(workdir if "://" in workdir else os.path.abspath(workdir))
  if p.exists() and not p.is_dir():
    raise RunDirError(f"--workdir={workdir} is a file; expected a directory (new or a run's)")
  return p


def checkpoints(workdir: str) -> str:
  return str(path(workdir) / CHECKPOINTS)


def checkpoint_data(workdir: str, step: int, process: int, processes: int) -> epath.Path:
  """Where a checkpoint keeps one process's data-iterator state (grain's file name)."""
  return (path(workdir) / CHECKPOINTS / str(step) / "data"
          / f"process_{process}-of-{processes}.json")


def is_export(workdir: str) -> bool:
  """An exported folder (export.py), read by the modes as they read a run directory."""
  return (epath.Path(workdir) / RUN_CONFIG).exists()


def tokenizer(workdir: str) -> str:
  """The run's tokenizer directory (an exported folder holds its files at the top)."""
  return workdir.rstrip("/") if is_export(workdir) else f"{workdir.rstrip('/')}/{TOKENIZER}"


def metrics(workdir: str) -> epath.Path:
  return path(workdir) / METRICS


def read_metrics(workdir: str) -> list[dict] | None:
  """metrics.jsonl's records (past a torn tail: `read_log`), or None when the run has
  logged none."""
  p = metrics(workdir)
  return read_log(p)[0] if p.exists() else None


def read_log(p: epath.Path) -> tuple[list[dict], int]:
  """An append-only JSON-lines file's records and the length in bytes of the part that
  holds them. A tail that does not parse (the part line a crash or a full disk leaves
  mid-append) is left out, as a write-ahead log drops a torn tail; a line that does not
  parse with records after it is damage, not a tear: RunDirError names it."""
  records, good, offset, torn = [], 0, 0, None
  for n, line in enumerate(p.read_bytes().splitlines(keepends=True), 1):
    offset += len(line)
    try:
      record = json.loads(line) if line.strip() else None
    except ValueError:
      torn = torn or n
      continue
    if torn:
      raise RunDirError(f"{p}: line {torn} is not a JSON record, and records follow it; the "
                        "log is damaged, not torn (restore it, or remove that line)")
    records += [] if record is None else [record]
    good = offset
  return records, good


def cut_torn_tails(workdir: str, log=print) -> None:
  """A resume's repair of the run's append-only logs (metrics.jsonl, config_changes.jsonl):
  a torn tail is cut, with a line saying how many bytes."""
  for name in (METRICS, CONFIG_CHANGES):
    p = path(workdir) / name
    if not p.exists():
      continue
    data = p.read_bytes()
    _, good = read_log(p)
    kept = data[:good] + (b"\n" if good and not data[:good].endswith(b"\n") else b"")
    if kept != data:
      p.write_bytes(kept)
      log(f"{p}: cut {len(data) - good} bytes of a torn last line (an interrupted write)"
          if good < len(data) else f"{p}: ended its last line (an interrupted write)")


def core(workdir: str) -> epath.Path:
  return path(workdir) / CORE


def profile(workdir: str) -> str:
  return f"{str(path(workdir)).rstrip('/')}/{PROFILE}"


def sweep_log(workdir: str, host: str) -> str:
  return f"{workdir.rstrip('/')}/log.{host}.txt"


def saved_steps(workdir: str) -> list[int]:
  """The steps checkpointed in a workdir, from its listing alone (no orbax manager: making
  one is a collective every process must join)."""
  d = path(workdir) / CHECKPOINTS
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def write_result(workdir: str, name: str, result: dict) -> None:
  """A mode's result (EVAL or CORE) beside the run."""
  (path(workdir) / name).write_text(json.dumps(result))


# -- finished runs ----------------------------------------------------------------------

def is_done(workdir: str) -> bool:
  return (epath.Path(workdir) / DONE).exists()


def mark_done(workdir: str, last: dict) -> None:
  (path(workdir) / DONE).write_text(json.dumps(last))


def clear_done(workdir: str) -> None:
  """Training goes on (more steps asked for): not finished until it ends again."""
  done = path(workdir) / DONE
  if done.exists():
    done.unlink()


# -- the config of record ---------------------------------------------------------------

def read_config(workdir: str) -> ml_collections.ConfigDict | None:
  """The workdir's config.json (an exported folder's run_config.json) over the schema's
  defaults (so a config written before a setting existed still reads), or None when
  there is none."""
  p = path(workdir) / (RUN_CONFIG if is_export(workdir) else CONFIG)
  if not p.exists():
    return None
  cfg = config_lib.base_config()
  for key, value in config_lib.flatten(json.loads(p.read_text())).items():
    config_lib.assign(cfg, key, value)  # a setting the schema no longer has is dropped
  return cfg


def config_of(workdir: str) -> ml_collections.ConfigDict:
  """read_config for a command that needs a run: RunDirError when WORKDIR holds none."""
  cfg = read_config(workdir)
  if cfg is None:
    raise RunDirError(f"--workdir={workdir} holds no {CONFIG} or {RUN_CONFIG}: expected a "
                      "bov_jax run directory or an exported folder")
  return cfg


def write_config(workdir: str, cfg) -> None:
  d = path(workdir)
  d.mkdir(parents=True, exist_ok=True)
  (d / CONFIG).write_text(cfg.to_json(indent=2))


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
    changes = path(workdir) / CONFIG_CHANGES
    before = changes.read_text() if changes.exists() else ""
    changes.write_text(before + json.dumps(record) + "\n")
    write_config(workdir, cfg)


# -- one owner at a time ------------------------------------------------------------------

class Busy(RunDirError):
  """Another live run owns the run directory."""


class Owner:
  """The lock of a training run on its run directory (local or gs://), as a database
  holds its data directory: LOCK names the holder (host, pid) and carries a heartbeat
  the holder rewrites every BEAT seconds. A second run finds a live holder and stops; a
  holder that died without releasing (kill -9, a preempted pod) is known by its pid (on
  the same host) or by a heartbeat that stops (elsewhere), and its lock is taken over."""

  BEAT = 5.0  # seconds between heartbeats; a holder elsewhere is dead after 3 unchanged

  def __init__(self, workdir: str, log=print):
    self.file = path(workdir) / LOCK
    self.me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    self._stop = threading.Event()
    self._thread = None
    held = self._holder()
    if held is not None and self._alive(held):
      raise Busy(f"--workdir={workdir} is in use by another run (host {held.get('host')}, "
                 f"pid {held.get('pid')}, since {time.ctime(held.get('since', 0))}); wait for "
                 "it to end, or use another --workdir")
    if held is not None:
      log(f"{self.file}: taking over from a run that ended without releasing it (host "
          f"{held.get('host')}, pid {held.get('pid')})")
    self.file.parent.mkdir(parents=True, exist_ok=True)
    self._write()
    self._thread = threading.Thread(target=self._beat, daemon=True, name="bov_jax-lock")
    self._thread.start()

  def _holder(self) -> dict | None:
    try:
      return json.loads(self.file.read_text())
    except FileNotFoundError:
      return None
    except ValueError:  # torn by a holder that died writing it: no one holds it
      return {}

  def _alive(self, held: dict) -> bool:
    if not held:
      return False
    if held.get("host") == self.me["host"]:
      try:
        os.kill(int(held["pid"]), 0)
      except ProcessLookupError:
        return False
      except PermissionError:  # another user's live process
        return True
      return time.time() - held.get("beat", 0) < 3 * self.BEAT  # not a reused pid
    for _ in range(3):  # elsewhere: alive while its heartbeat moves
      time.sleep(self.BEAT)
      now = self._holder()
      if now is None or now.get("beat") != held.get("beat"):
        return now is not None
    return False

  def _write(self) -> None:
    self.file.write_text(json.dumps(dict(self.me, beat=time.time())))

  def _beat(self) -> None:
    while not self._stop.wait(self.BEAT):
      try:
        self._write()
      except OSError:  # a full disk or a lost bucket: the run itself will say so
        pass

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    held = self._holder()
    if held and held.get("pid") == self.me["pid"] and held.get("host") == self.me["host"]:
      self.file.unlink()
