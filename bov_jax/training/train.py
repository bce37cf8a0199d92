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
from bov_jax.data import corpus
from bov_jax.data import sources
from bov_jax.evaluation import bpb
from bov_jax.evaluation import core
from bov_jax.host import process
from bov_jax.host.process import log
from bov_jax.inference import generate as inference
from bov_jax.model import params as params_lib
from bov_jax.optim import optimizer as optim
from bov_jax.parallel import sharding
from bov_jax.run import plan
from bov_jax.store import checkpoint as ckpt_lib
from bov_jax.store import metrics
from bov_jax.store import profiler
from bov_jax.store import rundir
from bov_jax.store import safetensors
from bov_jax.training import aot
from bov_jax.training import preemption as preemption_lib
from bov_jax.training import step as step_lib

# Exit code of a run stopped by a preemption after its checkpoint: the same command
# resumes it (sysexits' EX_TEMPFAIL, "try again"; 0 is done, 1 failed, 2 bad input).
PREEMPTED_EXIT = 75


class TrainError(RuntimeError):
  pass


def train(spec, workdir: str | None) -> dict:
  """Trains per the spec; resumes from WORKDIR's latest checkpoint. Returns the last record."""
  mesh = sharding.make_mesh(spec.mesh)    # the config is checked (spec.resolve); the corpus
  splits = sources.documents(spec)        # is found and the tokenizer's size checked,
  sources.check_tokenizer(spec, workdir)  # before anything is written
  owner = _open_rundir(spec, workdir) if workdir else None
  try:
    tok = sources.tokenizer(spec, workdir, splits[0])
    num_steps = plan.num_iterations(spec, plan.flops_per_token(spec.model))
    ckpts = ckpt_lib.Checkpoints(workdir, keep=spec.train.keep_checkpoints) if workdir else None
    # With checkpoints there, the run restores one (or fails, naming them): the state
    # to restore into is abstract, never initialised. Process 0's answer holds for all:
    # init is one program every process must run, or none.
    resuming = ckpts is not None and bool(ckpts.all_steps())
    if jax.process_count() > 1:
      resuming = bool(multihost_utils.broadcast_one_to_all(np.int32(resuming)))
    setup = step_lib.build(spec, mesh, num_steps, init=not resuming)
    if spec.init_from and not resuming:  # weights from an exported folder
      setup.params = params_lib.placed(safetensors.read_weights(spec.init_from), setup.params,
                                       f"model.init_from={spec.init_from}")
    with jax.set_mesh(mesh):
      run, state = _set_up(spec, workdir, mesh, setup, tok, splits, num_steps, ckpts)
      return _loop(run, state)
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


@dataclasses.dataclass
class _Run:
  """What a run holds for all of its steps, set up once before the first."""
  spec: object
  workdir: str | None
  mesh: object
  setup: step_lib.TrainSetup
  tok: object
  last_step: int
  ckpts: ckpt_lib.Checkpoints | None
  data: object  # the data iterator (its state is saved with every checkpoint)
  evaluator: bpb.Evaluator
  writer: metrics.Writer
  throughput: metrics.Throughput
  preemption: preemption_lib.Preemption
  profiler: profiler.Profiler
  first: int  # this process's first step: it compiles
  started: float = dataclasses.field(default_factory=time.time)
  compile_began: float = 0.0
  train_step: object = None  # compiled before the first step


@dataclasses.dataclass
class _InFlight:
  """A dispatched step whose outputs have not been read yet."""
  step: int
  out: dict
  data_wait_s: float
  stop: object  # the agreed preemption flag of this step (preemption.py)


@dataclasses.dataclass
class _State:
  """What the loop carries from one step to the next."""
  step: int  # the last step dispatched: 0 for a new run
  params: object
  opt_state: object
  batch: tuple | None = None  # the next step's (inputs, targets), and the seconds it took
  in_flight: _InFlight | None = None  # read one step late, while the next one runs
  record: dict = dataclasses.field(default_factory=dict)  # the latest step's record
  stop_requested: bool = False  # a preemption flag read, agreed by every process


def _loop(run: _Run, state: _State) -> dict:
  """The run's steps. After each: whether to stop, then the actions due (all decided
  before any runs, so none decides for another), then the step's record."""
  last_step, train_cfg, eval_cfg = run.last_step, run.spec.train, run.spec.eval
  _begin(run, state)
  while state.step < last_step:
    step = _dispatch(run, state)  # the step starts on the device; the one before is read
    stop = state.stop_requested or run.preemption.maintenance(step)
    end = step == last_step
    save = run.ckpts is not None and (stop or end or _every(step, train_cfg.checkpoint_every))
    evaluate = end or _every(step, train_cfg.eval_every)
    core_due = _core_on(run.spec) and (end or _every(step, eval_cfg.core_every))
    if run.profiler.due(step):
      run.profiler.after(step, sync=lambda: jax.block_until_ready(state.params))
    next_batch = None
    # The next batch loads while the device runs this step, except before a checkpoint:
    # the data iterator's state it saves must be the one right after this step.
    if not end and not save:
      next_batch = _load(run, state)
    if evaluate:
      _timed(run, state, "val_bpb", lambda: run.evaluator(state.params))
    if core_due:
      _timed(run, state, "core", lambda: core.run(run.spec, run.setup.graphdef, state.params,
                                                  run.tok)["core"])
    if save:
      _save(run, state, final=stop or end)
    if end and not stop:
      _sample(run, state)
    if (stop or evaluate or core_due or save or end or step == run.first
        or _every(step, train_cfg.log_every)):  # what those actions measured is in the record
      _write_record(run, state)
    if stop:
      return _stop(run, state)
    if next_batch is None and not end:
      next_batch = _load(run, state)
    state.batch = next_batch
  return _end(run, state)


def _every(step: int, every: int) -> bool:
  return every > 0 and step % every == 0


def _core_on(spec) -> bool:
  return bool(spec.eval.core_bundle) and spec.eval.core_every > 0


# -- set-up --------------------------------------------------------------------------------

def _set_up(spec, workdir, mesh, setup, tok, splits, last_step, ckpts) -> tuple[_Run, _State]:
  """The run's fixed parts, and the state of its newest checkpoint (a new run's
  initial state with none)."""
  state = _State(step=0, params=setup.params, opt_state=setup.opt_state)
  data = _batches(spec, setup, tok, splits[0], spec.train.seed)
  restored = ckpts.restore(state.params, state.opt_state, data, log=log,
                           set_aside=True) if ckpts is not None else None
  if restored is not None:
    state.step, state.params, state.opt_state = (restored.step, restored.params,
                                                 restored.opt_state)
    if not restored.data_restored:
      data = _batches(spec, setup, tok, splits[0], _resume_seed(spec.train.seed, restored.step))
    log(f"resumed from {rundir.checkpoints(workdir)}/{restored.step}")
  n_dev, cpu = jax.device_count(), jax.devices()[0].platform == "cpu"
  throughput = metrics.Throughput(
      spec.train.batch_tokens, plan.flops_per_token(spec.model), metrics.peak_flops() * n_dev,
      remeasure=(lambda: metrics.peak_flops(again=True) * n_dev) if cpu else None)
  run = _Run(
      spec=spec, workdir=workdir, mesh=mesh, setup=setup, tok=tok, last_step=last_step,
      ckpts=ckpts,
      data=data, first=state.step + 1,
      evaluator=bpb.Evaluator(spec, mesh, setup.eval_step, splits[1], tok,
                              setup.layout.local_rows),
      writer=metrics.Writer(workdir, state.step, spec.log, json.loads(spec.config_json)),
      throughput=throughput, preemption=preemption_lib.Preemption(mesh),
      profiler=profiler.Profiler(workdir, spec.log.profile_start_step, spec.log.profile_steps))
  return run, state


def _batches(spec, setup, tok, train_split, seed: int):
  windows = data_lib.TrainWindows(train_split, tok, seed, jax.process_index(),
                                  jax.process_count())
  return data_lib.train_batches(windows, spec.model.sequence_len + 1, setup.layout.local_rows)


def _begin(run: _Run, state: _State) -> None:
  """The run's header, a new run's step-0 evaluation, the first batch, and the train
  step compiled on it, with the bytes it takes per device logged (what --mode=compile
  reports for a slice)."""
  log(f"bov_jax: {run.spec.model.describe()} | {run.last_step} steps x "
      f"{run.spec.train.batch_tokens:,} tokens (accum {run.setup.layout.accum}) | "
      f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
  if state.step == 0:
    state.record = {"step": 0, "val_bpb": run.evaluator(state.params), "tokens": 0}
    run.writer.write(state.record)
    log(f"step 0 | val_bpb {state.record['val_bpb']:.4f}")
  run.compile_began = time.perf_counter()
  state.batch = _load(run, state)
  (x, y), _ = state.batch
  run.train_step = run.setup.train_step.lower(state.params, state.opt_state, x, y).compile()
  stats = jax.local_devices()[0].memory_stats() or {}
  log(aot.memory_line("train_step", aot.memory(run.train_step), stats.get("bytes_limit")))
  if run.profiler.due(state.step):  # a trace that starts with this run's first step
    run.profiler.after(state.step, sync=lambda: jax.block_until_ready(state.params))


# -- a step, read one step late ------------------------------------------------------------

def _load(run: _Run, state: _State):
  """The next step's global batch [accum, rows, T] (inputs, targets), and the seconds
  the host spent making it."""
  t0 = time.perf_counter()
  before = run.data.get_state()
  try:
    local = np.stack([next(run.data) for _ in range(run.setup.layout.accum)])  # [A, rows, T+1]
  except corpus.DataError as e:
    raise _bad_data(run, state, e, before) from e
  x = sharding.global_batch(local[:, :, :-1], run.mesh, leading_dims=2)
  y = sharding.global_batch(local[:, :, 1:], run.mesh, leading_dims=2)
  return (x, y), time.perf_counter() - t0


def _bad_data(run: _Run, state: _State, e: Exception, before) -> Exception:
  """A corpus file found bad while training: the run stops at a checkpoint of its last
  step (the data order as it was before the failed batch), so that the same command,
  once the file is mended, goes on from there. Several processes cannot agree on it
  (the others wait in the next step): they stop at the last periodic checkpoint."""
  if state.step < run.first:  # before this run's first step: plain bad input (exit 2)
    return e
  saved = run.ckpts.latest_step() if run.ckpts else None
  if run.ckpts is not None and jax.process_count() == 1 and saved != state.step:
    _read_in_flight(run, state)  # the step's loss read (and checked) before it is kept
    run.data.set_state(before)
    _save(run, state, final=True)
    run.ckpts.close()
    saved = state.step
  where = f"{rundir.checkpoints(run.workdir)}/{saved}" if saved is not None else "none"
  return TrainError(f"{e}; stopped after step {state.step} (checkpoint: {where}). Mend or "
                    "replace that file and run the same command to resume")


def _dispatch(run: _Run, state: _State) -> int:
  """Runs the next step on the loaded batch, then reads the step before it: the device
  starts this one before the host waits for that one. Returns the step's number."""
  (x, y), wait = state.batch
  state.params, state.opt_state, out = run.train_step(state.params, state.opt_state, x, y)
  flag = run.preemption.dispatch()
  state.step += 1
  previous, state.in_flight = state.in_flight, _InFlight(state.step, out, wait, flag)
  if previous is not None:
    _read(run, state, previous)
  return state.step


def _read_in_flight(run: _Run, state: _State) -> dict:
  """This step's record, its outputs read now (the device has finished it, or is about
  to)."""
  if state.in_flight is not None:
    _read(run, state, state.in_flight)
    state.in_flight = None
  return state.record


def _read(run: _Run, state: _State, done: _InFlight) -> None:
  """A step's loss (checked), its stop flag, and its time for the throughput window."""
  loss = float(done.out["train_loss"])
  if not math.isfinite(loss):
    good = run.ckpts.latest_step() if run.ckpts else None
    where = (f"{rundir.checkpoints(run.workdir)}/{good}" if good is not None
             else "none (no checkpoint was written)")
    raise TrainError(f"train_loss is {loss} at step {done.step}; stopping. "
                     f"Last good checkpoint: {where}")
  state.stop_requested = state.stop_requested or bool(done.stop)
  optim_spec = run.spec.optim
  lr = optim.lr_multiplier(done.step - 1, run.last_step, optim_spec.warmup_steps,
                           optim_spec.warmdown_ratio, optim_spec.final_lr_frac)
  state.record = {"step": done.step, "train_loss": loss, "lr": float(lr),
                  "tokens": done.step * run.spec.train.batch_tokens}
  if done.step == run.first:
    state.record["compile_s"] = time.perf_counter() - run.compile_began  # compile + one step
    run.throughput.begin()
  else:
    run.throughput.step_done(done.data_wait_s)


# -- the actions ---------------------------------------------------------------------------

def _timed(run: _Run, state: _State, key: str, evaluate) -> None:
  """An evaluation's result in the step's record; its time in the record and out of the
  throughput window."""
  t0 = time.perf_counter()
  _read_in_flight(run, state)[key] = evaluate()
  seconds = time.perf_counter() - t0
  state.record["eval_s"] = state.record.get("eval_s", 0.0) + seconds
  run.throughput.exclude(seconds)


def _save(run: _Run, state: _State, final: bool) -> None:
  run.ckpts.save(state.step, state.params, state.opt_state, run.data,
                 {"step": state.step, "train_loss": state.record.get("train_loss"),
                  "processes": jax.process_count()}, force=final)


def _sample(run: _Run, state: _State) -> None:
  """A greedy continuation of sample.prompt (every process runs the jitted steps;
  process 0 prints)."""
  new_tokens = run.spec.train.sample_tokens
  if new_tokens <= 0:
    return
  prompt = run.tok.encode(run.spec.sample.prompt)
  if (why := inference.prompt_too_long(len(prompt), run.spec.model.sequence_len)):
    log(f"sample: skipped, {why}")
    return
  ids = inference.generate_uncached(run.setup.graphdef, state.params, prompt, new_tokens,
                                    run.spec.model.sequence_len, temperature=0.0)
  log("sample: " + repr(run.tok.decode(prompt[1:] + ids)))


def _write_record(run: _Run, state: _State) -> None:
  record = _read_in_flight(run, state)
  record.update(run.throughput.read())
  run.writer.write(record)
  log(metrics.progress_line(record, run.last_step, run.spec.train.batch_tokens))


# -- the end -------------------------------------------------------------------------------

def _close(run: _Run, state: _State) -> None:
  run.profiler.close(sync=lambda: jax.block_until_ready(state.params))
  if run.ckpts is not None:
    run.ckpts.close()  # waits for the last save to be on disk
  run.writer.close()


def _stop(run: _Run, state: _State) -> dict:
  _close(run, state)
  log(f"preempted: checkpointed step {state.step}; exiting with code {PREEMPTED_EXIT} "
      "(run the same command to resume)")
  return dict(state.record, preempted=True)


def _end(run: _Run, state: _State) -> dict:
  _close(run, state)
  if run.workdir and process.is_main():
    rundir.mark_done(run.workdir, state.record)  # sweeps and launch/tpu.sh skip it
  log(f"done in {metrics.fmt_time(time.time() - run.started)}")
  return state.record
