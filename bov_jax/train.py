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
from jax.experimental import multihost_utils
import numpy as np

from bov_jax import aot
from bov_jax import bpb
from bov_jax import checkpoint as ckpt_lib
from bov_jax import data as data_lib
from bov_jax import inference
from bov_jax import metrics
from bov_jax import optim
from bov_jax import plan
from bov_jax import preemption as preemption_lib
from bov_jax import run as run_lib
from bov_jax import sharding
from bov_jax import step as step_lib
from bov_jax.run import log

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
  mesh = sharding.make_mesh(spec.mesh)
  train_split, val_split = run_lib.documents(spec)  # a missing corpus is named before
  if workdir:                                       # anything is written
    delta = ckpt_lib.check_config(workdir, spec.config())  # every process checks
    if jax.process_count() > 1:  # all have read config.json before process 0 rewrites it
      multihost_utils.sync_global_devices("bov_jax: config checked")
    if run_lib.is_main():
      ckpt_lib.record_config(workdir, spec.config(), delta, log=log)
    done = ckpt_lib.path(workdir) / "DONE"
    if run_lib.is_main() and done.exists():
      done.unlink()  # training goes on (more steps asked for): not finished until it ends
  tok = run_lib.tokenizer(spec, workdir, train_split)
  fpt = plan.flops_per_token(spec.model)
  n = plan.num_iterations(spec, fpt)
  ckpts = ckpt_lib.Checkpoints(workdir, keep=spec.train.keep_checkpoints) if workdir else None
  # With checkpoints there, the run restores one (or fails, naming them): the state
  # to restore into is abstract, never initialised. Process 0's answer holds for all:
  # init is one program every process must run, or none.
  resuming = ckpts is not None and bool(ckpts.all_steps())
  if jax.process_count() > 1:
    resuming = bool(multihost_utils.broadcast_one_to_all(np.int32(resuming)))
  trainer = step_lib.build(spec, mesh, n, init=not resuming)
  with jax.set_mesh(mesh):
    return _Loop(spec, workdir, mesh, trainer, tok, train_split, val_split, n, fpt, ckpts).run()


class _Loop:

  def __init__(self, spec, workdir, mesh, trainer, tok, train_split, val_split, n, fpt, ckpts):
    self.spec, self.workdir, self.mesh, self.trainer, self.tok = spec, workdir, mesh, trainer, tok
    self.n, self.fpt = n, fpt
    t = spec.train
    self.layout = trainer.layout
    self.train_split = train_split
    self.it = self._batches(t.seed)
    self.evaluator = bpb.Evaluator(spec, mesh, trainer.eval_step, val_split, tok,
                                   self.layout.local_rows)
    self.ckpts = ckpts
    self.params, self.opt_state = trainer.params, trainer.opt_state
    self.tput = metrics.Throughput(t.batch_tokens, fpt, metrics.peak_flops() * jax.device_count())

  def _batches(self, seed: int):
    windows = data_lib.TrainWindows(self.train_split, self.tok, seed, jax.process_index(),
                                    jax.process_count())
    return data_lib.train_batches(windows, self.spec.model.sequence_len + 1,
                                  self.layout.local_rows)

  def _load(self):
    """The next step's global batch [accum, rows, T] (inputs, targets), and the seconds
    the host spent making it."""
    t0 = time.perf_counter()
    local = np.stack([next(self.it) for _ in range(self.layout.accum)])  # [A, rows, T+1]
    x = sharding.global_batch(local[:, :, :-1], self.mesh, leading_dims=2)
    y = sharding.global_batch(local[:, :, 1:], self.mesh, leading_dims=2)
    return (x, y), time.perf_counter() - t0

  def _record(self, p: _Pending) -> dict:
    """Reads a step's loss (the device has finished it, or is about to) and checks it."""
    loss = float(p.out["train_loss"])
    if not math.isfinite(loss):
      good = self.ckpts.latest_step() if self.ckpts else None
      where = (f"{ckpt_lib.checkpoint_dir(self.workdir)}/{good}" if good is not None
               else "none (no checkpoint was written)")
      raise TrainError(f"train_loss is {loss} at step {p.step}; stopping. "
                       f"Last good checkpoint: {where}")
    o = self.spec.optim
    return {"step": p.step, "train_loss": loss,
            "lr": float(optim.lr_multiplier(p.step - 1, self.n, o.warmup_steps,
                                            o.warmdown_ratio, o.final_lr_frac)),
            "tokens": p.step * self.spec.train.batch_tokens}

  def run(self) -> dict:
    spec, t = self.spec, self.spec.train
    t_start = time.time()
    step = 0
    if self.ckpts is not None:
      restored = self.ckpts.restore(self.params, self.opt_state, self.it, log=log)
      if restored is not None:
        step, self.params, self.opt_state = restored.step, restored.params, restored.opt_state
        if not restored.data_restored:  # saved by another number of processes: a new order
          self.it = self._batches(seed=self.spec.train.seed + 1_000_003 * step)
        log(f"resumed from {ckpt_lib.checkpoint_dir(self.workdir)}/{step}")
    self.writer = metrics.Writer(self.workdir, step, spec.log, json.loads(spec.config_json))
    log(f"bov_jax: {spec.model.describe()} | {self.n} steps x {t.batch_tokens:,} tokens "
        f"(accum {self.layout.accum}) | {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s)")
    self.last = {}
    if step == 0:
      self.last = {"step": 0, "val_bpb": self.evaluator(self.params), "tokens": 0}
      self.writer.write(self.last)
      log(f"step 0 | val_bpb {self.last['val_bpb']:.4f}")
    preemption = preemption_lib.Preemption(self.mesh)
    self.stop = False  # agreed: stop after the next step boundary (set by _finish)
    self.first, self.t_compile = step + 1, time.perf_counter()
    batch, wait = self._load()
    train_step = self._compile(batch)
    pending = None
    while step < self.n:
      self.params, self.opt_state, out = train_step(self.params, self.opt_state, *batch)
      flag = preemption.dispatch()
      step += 1
      if pending is not None:  # the previous step: done, or finishing as this one starts
        self._finish(pending)
      pending = _Pending(step, out, wait, flag)
      stop = self.stop or preemption.maintenance(step)
      save = self.ckpts is not None and (step % t.checkpoint_every == 0 or step == self.n
                                         or stop)
      if step < self.n and not save:
        batch, wait = self._load()  # while the device runs this step
      evaluate = step % t.eval_every == 0 or step == self.n
      core = bool(spec.eval.core_bundle) and spec.eval.core_every > 0 and (
          step % spec.eval.core_every == 0 or step == self.n)
      if (save or evaluate or core or stop or step == self.first
          or step % t.log_every == 0):
        self._finish(pending, log_it=True, evaluate=evaluate, core=core)
        pending = None
      if save:
        self.ckpts.save(step, self.params, self.opt_state, self.it,
                        {"step": step, "train_loss": self.last.get("train_loss")},
                        force=stop or step == self.n)
        if step < self.n and not stop:
          batch, wait = self._load()
      if stop:
        self.ckpts and self.ckpts.close()
        self.writer.close()
        log(f"preempted: checkpointed step {step}; exiting with code {PREEMPTED_EXIT} "
            "(run the same command to resume)")
        return dict(self.last, preempted=True)
    if self.ckpts is not None:
      self.ckpts.close()
    self.writer.close()
    self._sample()
    if self.workdir and run_lib.is_main():
      (ckpt_lib.path(self.workdir) / "DONE").write_text(json.dumps(self.last))  # sweeps skip it
    log(f"done in {metrics.fmt_time(time.time() - t_start)}")
    return self.last

  def _compile(self, batch):
    """The train step compiled before its first call, with the bytes it takes per
    device logged (what --mode=compile reports for a slice)."""
    compiled = self.trainer.train_step.lower(self.params, self.opt_state, *batch).compile()
    stats = jax.local_devices()[0].memory_stats() or {}
    log(aot.memory_line("train_step", aot.memory(compiled), stats.get("bytes_limit")))
    return compiled

  def _finish(self, p: _Pending, log_it=False, evaluate=False, core=False) -> None:
    """Reads a dispatched step's outputs; with log_it, evaluates as asked and writes the
    record (tokens/s and MFU over the steps since the last one written)."""
    record = self._record(p)
    self.stop = self.stop or bool(p.stop)
    if p.step == self.first:
      record["compile_s"] = time.perf_counter() - self.t_compile  # compile + one step
      self.tput.begin()
    else:
      self.tput.step_done(p.data_wait_s)
    if log_it:
      t0 = time.perf_counter()
      if evaluate:
        record["val_bpb"] = self.evaluator(self.params)
      if core:
        from bov_jax import modes
        record["core"] = modes.run_core(self.spec, self.trainer.graphdef, self.params,
                                        self.tok)["core"]
      if evaluate or core:
        record["eval_s"] = time.perf_counter() - t0
        self.tput.exclude(record["eval_s"])
      record.update(self.tput.read())
      self.writer.write(record)
      log(metrics.progress_line(record, self.n, self.spec.train.batch_tokens))
    self.last = record

  def _sample(self):
    """A greedy continuation of sample.prompt (every process runs the jitted steps;
    process 0 prints)."""
    n = self.spec.train.sample_tokens
    if n <= 0:
      return
    prompt = self.tok.encode(self.spec.sample.prompt)
    if len(prompt) >= self.spec.model.sequence_len:
      log(f"sample: skipped, sample.prompt is {len(prompt)} tokens, the context is "
          f"{self.spec.model.sequence_len}")
      return
    ids = inference.generate_uncached(self.trainer.graphdef, self.params, prompt, n,
                                      self.spec.model.sequence_len, temperature=0.0)
    log("sample: " + repr(self.tok.decode(prompt[1:] + ids)))
