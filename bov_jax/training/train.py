"""The training loop: config -> model, optimizer, data -> step -> metrics and checkpoints.

The device is never made to wait for the host: a step's loss is read while the next
step runs (one step late), and the next batch is loaded while the current step runs,
except right before a checkpoint, whose data-iterator state must be the one after
the step it saves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from bov_jax.data import batches as data_lib
from bov_jax.data import sources
from bov_jax.evaluation import bpb
from bov_jax.evaluation import core
from bov_jax.inference import generate as inference
from bov_jax.model import params as params_lib
from bov_jax.optim import optimizer as optim
from bov_jax.parallel import sharding
from bov_jax.run import plan
from bov_jax.runtime import process
from bov_jax.runtime.process import log
from bov_jax.store import checkpoint as ckpt_lib
from bov_jax.store import metrics
from bov_jax.store import profiler
from bov_jax.store import rundir
from bov_jax.store import safetensors
from bov_jax.training import aot
from bov_jax.training import preemption as preemption_lib
from bov_jax.training import schedule as schedule_lib
from bov_jax.training import step as step_lib

# Exit code of a run stopped by a preemption after its checkpoint: the same command
# resumes it (sysexits' EX_TEMPFAIL, "try again"; 0 is done, 1 failed, 2 bad input).
PREEMPTED_EXIT = 75


class TrainError(RuntimeError):
  pass


@dataclasses.dataclass
class _Pending:
  """A dispatched step whose outputs have not been read yet."""
  step: int
  out: dict
  data_wait_s: float
  stop: object  # the agreed preemption flag of this step (preemption.py)


def train(spec, workdir: str | None) -> dict:
  """Trains per the spec; resumes from WORKDIR's latest checkpoint. Returns the last record."""
  mesh = sharding.make_mesh(spec.mesh)    # the config is checked (spec.resolve); the corpus
  splits = sources.documents(spec)        # is found and the tokenizer's size checked,
  sources.check_tokenizer(spec, workdir)  # before anything is written
  owner = _open_rundir(spec, workdir) if workdir else None
  try:
    tok = sources.tokenizer(spec, workdir, splits[0])
    n = plan.num_iterations(spec, plan.flops_per_token(spec.model))
    ckpts = ckpt_lib.Checkpoints(workdir, keep=spec.train.keep_checkpoints) if workdir else None
    # With checkpoints there, the run restores one (or fails, naming them): the state
    # to restore into is abstract, never initialised. Process 0's answer holds for all:
    # init is one program every process must run, or none.
    resuming = ckpts is not None and bool(ckpts.all_steps())
    if jax.process_count() > 1:
      resuming = bool(multihost_utils.broadcast_one_to_all(np.int32(resuming)))
    setup = step_lib.build(spec, mesh, n, init=not resuming)
    if spec.init_from and not resuming:  # weights from an exported folder
      setup.params = params_lib.placed(safetensors.read_weights(spec.init_from), setup.params,
                                       f"model.init_from={spec.init_from}")
    with jax.set_mesh(mesh):
      return _Loop(spec, workdir, mesh, setup, tok, splits, n, ckpts).run()
  finally:
    if owner is not None:
      owner.release()


def _open_rundir(spec, workdir: str):
  """Checks the run directory's config of record against this run's (every process),
  takes the directory (process 0, for all: rundir.Owner; a live holder stops every
  process before anything is written) and records the config (process 0); a finished
  run asked for more steps is not finished any more. Returns process 0's Owner."""
  delta = rundir.check_config(workdir, spec.config())
  owner, busy = None, ""
  if process.is_main():
    try:
      owner = rundir.Owner(workdir, log=log)
    except rundir.Busy as e:
      busy = str(e)
  if jax.process_count() > 1:  # all have read config.json; process 0's answer holds for all
    if multihost_utils.broadcast_one_to_all(np.int32(bool(busy))) and not busy:
      busy = f"--workdir={workdir} is in use by another run (process 0 found its lock)"
  if busy:
    raise rundir.Busy(busy)
  if process.is_main():
    rundir.cut_torn_tails(workdir, log=log)
    rundir.record_config(workdir, spec.config(), delta, log=log)
    rundir.clear_done(workdir)
  return owner


def _resume_seed(seed: int, step: int) -> int:
  """The data seed of a resume that cannot restore the iterator (saved by another number
  of processes): the step mixed in, so the new order does not replay the batches the
  run began with."""
  return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


class _Loop:
  """One run's training loop. All of its state is set up here, before the first step."""

  def __init__(self, spec, workdir, mesh, setup, tok, splits, n, ckpts):
    self.spec, self.workdir, self.mesh, self.tok = spec, workdir, mesh, tok
    self.setup, self.n, self.ckpts = setup, n, ckpts
    self.train_split = splits[0]
    self.evaluator = bpb.Evaluator(spec, mesh, setup.eval_step, splits[1], tok,
                                   self.setup.layout.local_rows)
    self.t_start = time.time()
    self.params, self.opt_state = setup.params, setup.opt_state
    self.it = self._batches(spec.train.seed)
    self.step = self._restore()  # the last step done: 0 for a new run
    self.first = self.step + 1   # its first step here compiles
    self.writer = metrics.Writer(workdir, self.step, spec.log, json.loads(spec.config_json))
    n_dev, cpu = jax.device_count(), jax.devices()[0].platform == "cpu"
    self.tput = metrics.Throughput(
        spec.train.batch_tokens, plan.flops_per_token(spec.model), metrics.peak_flops() * n_dev,
        remeasure=(lambda: metrics.peak_flops(again=True) * n_dev) if cpu else None)
    self.preemption = preemption_lib.Preemption(mesh)
    self.profiler = profiler.Profiler(workdir, spec.log.profile_start_step,
                                      spec.log.profile_steps)
    self.stop_agreed = False  # a preemption flag read (agreed by every process)
    self.stopping = False     # stop after this step: decided once per step, before its actions
    self.pending = None    # the dispatched step whose outputs are read one step late
    self.record = {}       # the latest step's record (returned, and written to DONE)
    self.batch = None      # the next step's batch and the seconds spent loading it
    self.t_compile = 0.0   # when the first step's compilation began
    self.train_step = None  # compiled before the first step (_compile)
    self.schedule = self._schedule()

  def _schedule(self) -> schedule_lib.Schedule:
    """What runs after each step. The actions are independent of one another but for one
    dependency, kept where it applies: a checkpoint saves the data iterator as it is
    right after its step, so the next batch is not prefetched when one is due
    (`_prefetch_due`); the checkpoint loads it once saved (`_save`). Whether to stop is
    decided before the actions (`_stop_due`), the step's record written after them
    (`_log`)."""
    t, e, s = self.spec.train, self.spec.eval, schedule_lib.Schedule(self.n)
    s.add("profile", self._profile, at_end=False, also=self.profiler.due)
    s.add("prefetch", self._prefetch, at_end=False, also=self._prefetch_due)
    s.add("evaluate", self._evaluate, every=t.eval_every)
    if e.core_bundle and e.core_every > 0:
      s.add("core", self._core, every=e.core_every)
    if self.ckpts is not None:
      s.add("checkpoint", self._save, every=t.checkpoint_every, also=lambda _: self.stopping)
    s.add("sample", self._sample)  # no setting: after the last step
    return s

  def run(self) -> dict:
    log(f"bov_jax: {self.spec.model.describe()} | {self.n} steps x "
        f"{self.spec.train.batch_tokens:,} tokens (accum {self.setup.layout.accum}) | "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
    if self.step == 0:
      self.record = {"step": 0, "val_bpb": self.evaluator(self.params), "tokens": 0}
      self.writer.write(self.record)
      log(f"step 0 | val_bpb {self.record['val_bpb']:.4f}")
    self.t_compile = time.perf_counter()
    self.batch = self._load()
    self.train_step = self._compile(self.batch[0])
    if self.profiler.due(self.step):  # a trace that starts with this run's first step
      self._profile(self.step)
    while self.step < self.n:
      self._dispatch()
      self.stopping = self._stop_due(self.step)
      self.schedule.run(self.step)
      self._log(self.step)
      if self.stopping:
        return self._stop()
    return self._end()

  # -- set-up ----------------------------------------------------------------------------

  def _batches(self, seed: int):
    windows = data_lib.TrainWindows(self.train_split, self.tok, seed, jax.process_index(),
                                    jax.process_count())
    return data_lib.train_batches(windows, self.spec.model.sequence_len + 1,
                                  self.setup.layout.local_rows)

  def _restore(self) -> int:
    """The newest checkpoint's step, its state and data order taken; 0 with none."""
    if self.ckpts is None:
      return 0
    restored = self.ckpts.restore(self.params, self.opt_state, self.it, log=log,
                                  set_aside=True)
    if restored is None:
      return 0
    self.params, self.opt_state = restored.params, restored.opt_state
    if not restored.data_restored:
      self.it = self._batches(_resume_seed(self.spec.train.seed, restored.step))
    log(f"resumed from {rundir.checkpoints(self.workdir)}/{restored.step}")
    return restored.step

  def _compile(self, batch):
    """The train step compiled before its first call, with the bytes it takes per
    device logged (what --mode=compile reports for a slice)."""
    compiled = self.setup.train_step.lower(self.params, self.opt_state, *batch).compile()
    stats = jax.local_devices()[0].memory_stats() or {}
    log(aot.memory_line("train_step", aot.memory(compiled), stats.get("bytes_limit")))
    return compiled

  # -- a step, read one step late -------------------------------------------------------

  def _load(self):
    """The next step's global batch [accum, rows, T] (inputs, targets), and the seconds
    the host spent making it."""
    t0 = time.perf_counter()
    before = self.it.get_state()
    try:
      local = np.stack([next(self.it) for _ in range(self.setup.layout.accum)])  # [A, rows, T+1]
    except data_lib.DataError as e:
      raise self._bad_data(e, before) from e
    x = sharding.global_batch(local[:, :, :-1], self.mesh, leading_dims=2)
    y = sharding.global_batch(local[:, :, 1:], self.mesh, leading_dims=2)
    return (x, y), time.perf_counter() - t0

  def _bad_data(self, e: Exception, before) -> Exception:
    """A corpus file found bad while training: the run stops at a checkpoint of its last
    step (the data order as it was before the failed batch), so that the same command,
    once the file is mended, goes on from there. Several processes cannot agree on it
    (the others wait in the next step): they stop at the last periodic checkpoint."""
    if self.step < self.first:  # before this run's first step: plain bad input (exit 2)
      return e
    saved = self.ckpts.latest_step() if self.ckpts else None
    if self.ckpts is not None and jax.process_count() == 1 and saved != self.step:
      self._current()  # the step's loss read (and checked) before it is kept
      self.it.set_state(before)
      self._save_now(self.step, last=True)
      self.ckpts.close()
      saved = self.step
    where = f"{rundir.checkpoints(self.workdir)}/{saved}" if saved is not None else "none"
    return TrainError(f"{e}; stopped after step {self.step} (checkpoint: {where}). Mend or "
                      "replace that file and run the same command to resume")

  def _dispatch(self) -> None:
    """Runs the next step on the loaded batch, then reads the step before it: the
    device starts this one before the host waits for that one."""
    (x, y), wait = self.batch
    self.params, self.opt_state, out = self.train_step(self.params, self.opt_state, x, y)
    flag = self.preemption.dispatch()
    self.step += 1
    previous, self.pending = self.pending, _Pending(self.step, out, wait, flag)
    if previous is not None:
      self._read(previous)

  def _current(self) -> dict:
    """This step's record, its outputs read now (the device has finished it, or is
    about to)."""
    if self.pending is not None:
      self._read(self.pending)
      self.pending = None
    return self.record

  def _read(self, p: _Pending) -> None:
    """A step's loss (checked), its stop flag, and its time for the throughput window."""
    loss = float(p.out["train_loss"])
    if not math.isfinite(loss):
      good = self.ckpts.latest_step() if self.ckpts else None
      where = (f"{rundir.checkpoints(self.workdir)}/{good}" if good is not None
               else "none (no checkpoint was written)")
      raise TrainError(f"train_loss is {loss} at step {p.step}; stopping. "
                       f"Last good checkpoint: {where}")
    self.stop_agreed = self.stop_agreed or bool(p.stop)
    o = self.spec.optim
    self.record = {"step": p.step, "train_loss": loss,
                   "lr": float(optim.lr_multiplier(p.step - 1, self.n, o.warmup_steps,
                                                   o.warmdown_ratio, o.final_lr_frac)),
                   "tokens": p.step * self.spec.train.batch_tokens}
    if p.step == self.first:
      self.record["compile_s"] = time.perf_counter() - self.t_compile  # compile + one step
      self.tput.begin()
    else:
      self.tput.step_done(p.data_wait_s)

  # -- the actions ----------------------------------------------------------------------

  def _stop_due(self, step: int) -> bool:
    """Whether to stop after this step: a flag read so far, or a maintenance event,
    decided once before the step's actions, so every one of them sees one answer (a flag
    read during them counts from the next step)."""
    return self.stop_agreed or self.preemption.maintenance(step)

  def _profile(self, step: int) -> None:
    self.profiler.after(step, sync=lambda: jax.block_until_ready(self.params))

  def _prefetch_due(self, step: int) -> bool:
    """The next batch loads while the device runs this step, except before a checkpoint:
    the data-iterator state it saves must be the one right after this step."""
    return step < self.n and not self.schedule.is_due("checkpoint", step)

  def _prefetch(self, step: int) -> None:
    del step
    self.batch = self._load()

  def _evaluate(self, step: int) -> None:
    del step
    t0 = time.perf_counter()
    self._current()["val_bpb"] = self.evaluator(self.params)
    self._took(time.perf_counter() - t0)

  def _core(self, step: int) -> None:
    del step
    t0 = time.perf_counter()
    self._current()["core"] = core.run(self.spec, self.setup.graphdef, self.params,
                                       self.tok)["core"]
    self._took(time.perf_counter() - t0)

  def _took(self, seconds: float) -> None:
    """Evaluation time: in the record, and out of the throughput window."""
    self.record["eval_s"] = self.record.get("eval_s", 0.0) + seconds
    self.tput.exclude(seconds)

  def _log(self, step: int) -> None:
    """The step's record, written every train.log_every steps and after the last, after
    the first, and after every step that evaluates, saves or stops (what those actions
    measured is in it)."""
    due = (step % self.spec.train.log_every == 0 or step in (self.first, self.n)
           or self.stopping or any(self.schedule.is_due(name, step)
                                   for name in ("evaluate", "core", "checkpoint")))
    if not due:
      return
    record = self._current()
    record.update(self.tput.read())
    self.writer.write(record)
    log(metrics.progress_line(record, self.n, self.spec.train.batch_tokens))

  def _save(self, step: int) -> None:
    """A checkpoint of this step, then the next batch (whose loading it waited for)."""
    last = step == self.n or self.stopping
    self._save_now(step, last)
    if not last:
      self.batch = self._load()

  def _save_now(self, step: int, last: bool) -> None:
    self.ckpts.save(step, self.params, self.opt_state, self.it,
                    {"step": step, "train_loss": self.record.get("train_loss"),
                     "processes": jax.process_count()}, force=last)

  def _sample(self, step: int) -> None:
    """A greedy continuation of sample.prompt (every process runs the jitted steps;
    process 0 prints)."""
    n = self.spec.train.sample_tokens
    del step
    if n <= 0 or self.stopping:
      return
    prompt = self.tok.encode(self.spec.sample.prompt)
    if (why := inference.prompt_too_long(len(prompt), self.spec.model.sequence_len)):
      log(f"sample: skipped, {why}")
      return
    ids = inference.generate_uncached(self.setup.graphdef, self.params, prompt, n,
                                      self.spec.model.sequence_len, temperature=0.0)
    log("sample: " + repr(self.tok.decode(prompt[1:] + ids)))

  # -- the end --------------------------------------------------------------------------

  def _close(self) -> None:
    self.profiler.close(sync=lambda: jax.block_until_ready(self.params))
    if self.ckpts is not None:
      self.ckpts.close()  # waits for the last save to be on disk
    self.writer.close()

  def _stop(self) -> dict:
    self._close()
    log(f"preempted: checkpointed step {self.step}; exiting with code {PREEMPTED_EXIT} "
        "(run the same command to resume)")
    return dict(self.record, preempted=True)

  def _end(self) -> dict:
    self._close()
    if self.workdir and process.is_main():
      rundir.mark_done(self.workdir, self.record)  # sweeps and launch/tpu.sh skip it
    log(f"done in {metrics.fmt_time(time.time() - self.t_start)}")
    return self.record
