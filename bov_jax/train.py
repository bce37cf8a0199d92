"""The train step (pure, jitted) and the loop around it.

Data flows one way: config -> model, optimizer, data -> step -> metrics and
checkpoints. Parameters and optimizer state are plain pytrees (the model's
`nnx.split` state as a pure dict) so one `jax.jit` compiles the whole step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bov_jax import checkpoint as ckpt_lib
from bov_jax import config as config_lib
from bov_jax import data as data_lib
from bov_jax import inference
from bov_jax import model as model_lib
from bov_jax import optim
from bov_jax import plan as plan_lib
from bov_jax import sharding
from bov_jax import tokenizer as tok_lib

LN2 = math.log(2.0)


class TrainError(RuntimeError):
  pass


# -- pure steps ----------------------------------------------------------------------

def make_train_step(graphdef, tx):
  """step(params, opt_state, inputs [A, B, T], targets [A, B, T]) -> new state, metrics.

  Gradients are averaged over the A micro-batches with a lax.scan, so one
  compiled step reaches train.batch_tokens whatever fits in memory.
  """

  def loss_fn(params, x, y):
    return nnx.merge(graphdef, params).loss(x, y)

  def step(params, opt_state, inputs, targets):
    grad_fn = jax.value_and_grad(loss_fn)

    def micro(acc, xy):
      loss, grads = grad_fn(params, *xy)
      return jax.tree.map(jnp.add, acc, (loss, grads)), None

    n = inputs.shape[0]
    if n == 1:  # no accumulation loop to pay for
      loss, grads = grad_fn(params, inputs[0], targets[0])
    else:
      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
      (loss, grads), _ = jax.lax.scan(micro, zeros, (inputs, targets))
      loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"train_loss": loss}

  return step


def make_eval_step(graphdef):
  """(params, inputs, targets, token_bytes) -> (nats over byte-bearing targets, bytes)."""

  def eval_step(params, inputs, targets, token_bytes):
    nll = nnx.merge(graphdef, params).token_losses(inputs, targets)
    nb = token_bytes[jnp.maximum(targets, 0)] * (targets >= 0)
    return jnp.sum(jnp.where(nb > 0, nll, 0.0)), jnp.sum(nb).astype(jnp.float32)

  return eval_step


def bits_per_byte(nats: float, n_bytes: float) -> float:
  return float(nats) / (LN2 * float(n_bytes))


def init_params(cfg, mesh, key):
  """(graphdef, params, shardings): parameters created already sharded, inside one jit."""
  abstract = nnx.eval_shape(lambda: model_lib.build(cfg))
  shardings = sharding.named(mesh, sharding.param_specs(nnx.state(abstract), mesh))
  with jax.set_mesh(mesh):
    params = jax.jit(lambda k: nnx.to_pure_dict(nnx.state(model_lib.init_model_eager(cfg, k))),
                     out_shardings=shardings)(key)
  return nnx.graphdef(abstract), params, shardings


def micro_batch_rows(cfg, n_dev: int) -> int:
  """Rows per device per micro-batch: train.device_batch_size, or fewer when one
  step's batch is smaller than that many rows on every device."""
  T = cfg.model.sequence_len
  rows_total = cfg.train.batch_tokens // T
  if cfg.train.batch_tokens % T or rows_total % n_dev:
    raise config_lib.ConfigError(
        f"train.batch_tokens={cfg.train.batch_tokens} must be a multiple of "
        f"model.sequence_len x devices = {T} x {n_dev} = {T * n_dev}")
  per_device = min(cfg.train.device_batch_size, rows_total // n_dev)
  if (rows_total // n_dev) % per_device:
    raise config_lib.ConfigError(
        f"train.batch_tokens={cfg.train.batch_tokens} must be a multiple of "
        f"train.device_batch_size x devices x model.sequence_len = "
        f"{per_device} x {n_dev} x {T} = {per_device * n_dev * T}")
  return per_device


# -- setup -----------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
  """Everything a run needs, built once from the config."""
  cfg: object
  workdir: str | None
  mesh: object
  graphdef: object
  params: object
  param_shardings: object
  tok: tok_lib.BPETokenizer
  token_bytes: np.ndarray
  train_docs: object
  val_docs: object
  accum: int
  rows: int           # rows per micro-batch on this process
  num_iterations: int
  flops_per_token: int
  hp: dict


def use_compile_cache(cfg) -> None:
  """Turns on JAX's persistent compilation cache at train.compile_cache_dir, so that a
  restart, a resume or a sweep's next run of the same step loads the executable instead
  of compiling it again (minutes for a large model on a pod). JAX reads
  JAX_COMPILATION_CACHE_DIR itself; when that is set, it wins."""
  path = cfg.train.compile_cache_dir
  if not path or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  path = os.path.expanduser(path)
  if "://" not in path:  # a local directory: make it, and say once if it cannot be used
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      print(f"warning: train.compile_cache_dir={path!r} is unusable ({e}); compiling without "
            "the cache", file=sys.stderr)
      return
  jax.config.update("jax_compilation_cache_dir", path)


def _is_main() -> bool:
  return jax.process_index() == 0


def log(msg: str) -> None:
  if _is_main():
    print(msg, flush=True)


def setup(cfg, workdir: str | None) -> Run:
  config_lib.validate(cfg)
  mesh = sharding.make_mesh(cfg)
  T = cfg.model.sequence_len
  n_dev, n_local = jax.device_count(), jax.local_device_count()
  per_device = micro_batch_rows(cfg, n_dev)
  accum = cfg.train.batch_tokens // (per_device * n_dev * T)
  docs = data_lib.documents(cfg.data.corpus)
  pi, pc = jax.process_index(), jax.process_count()
  train_all = data_lib.split(docs, cfg.data.val_every, "train")
  val_all = data_lib.split(docs, cfg.data.val_every, "val")

  def tokenizer_texts():
    budget = cfg.data.tokenizer_chars
    for i in range(len(train_all)):
      text = train_all[i]
      yield text[:budget]
      budget -= len(text)
      if budget <= 0:
        return

  tok = tok_lib.load_or_train(workdir, tokenizer_texts, cfg.model.vocab_size)
  graphdef, params, shardings = init_params(cfg, mesh, jax.random.key(cfg.train.seed))
  fpt = plan_lib.flops_per_token(cfg)
  hp = plan_lib.hyperparams(cfg)
  return Run(cfg=cfg, workdir=workdir, mesh=mesh, graphdef=graphdef, params=params,
             param_shardings=shardings, tok=tok, token_bytes=tok.token_bytes(),
             train_docs=data_lib.shard(train_all, pi, pc),
             val_docs=data_lib.shard(val_all, pi, pc), accum=accum,
             rows=per_device * n_local,
             num_iterations=plan_lib.num_iterations(cfg, fpt), flops_per_token=fpt, hp=hp)


# -- evaluation ---------------------------------------------------------------------------

class Evaluator:
  """Validation bits per byte, always over the same held-out rows."""

  def __init__(self, run: Run):
    cfg = run.cfg
    T = cfg.model.sequence_len
    n_rows = max(1, cfg.train.eval_tokens // T // jax.process_count())
    n_rows = max(run.rows, n_rows // run.rows * run.rows)
    rows = data_lib.val_rows(run.val_docs, run.tok, T + 1, n_rows)
    n_rows = len(rows) // run.rows * run.rows
    if n_rows == 0:
      raise data_lib.DataError(
          f"the validation split packs into {len(rows)} rows, fewer than one batch of "
          f"{run.rows}; use a larger corpus or a smaller train.device_batch_size")
    self.batches = rows[:n_rows].reshape(-1, run.rows, T + 1)
    self.run = run
    self.token_bytes = jnp.asarray(run.token_bytes)
    self.fn = jax.jit(make_eval_step(run.graphdef))

  def __call__(self, params) -> float:
    nats = n_bytes = 0.0
    for b in self.batches:
      x = sharding.global_batch(b[:, :-1], self.run.mesh)
      y = sharding.global_batch(b[:, 1:], self.run.mesh)
      a, c = self.fn(params, x, y, self.token_bytes)
      nats += float(a)
      n_bytes += float(c)
    return bits_per_byte(nats, n_bytes)


# -- the loop --------------------------------------------------------------------------------

class _Stop:
  """SIGTERM sets a flag; the loop checkpoints and exits at the next step boundary."""

  def __init__(self):
    self.requested = False
    try:
      signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread
      pass

  def _handle(self, *_):
    self.requested = True


def _fmt_time(s: float) -> str:
  s = int(s)
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Metrics:
  """WORKDIR/metrics.jsonl: one JSON object per logged step (process 0 only).

  The file is rewritten whole (temp file, then rename) at each log line: no
  append is needed, so it works on gs:// too, and a crash never leaves half a
  line. On resume, lines past the resumed step are dropped so the file reads
  as one run.
  """

  def __init__(self, workdir, resume_step: int):
    from etils import epath
    self.path = epath.Path(workdir) / "metrics.jsonl" if workdir and _is_main() else None
    self.records = []
    if self.path and self.path.exists():
      for line in self.path.read_text().splitlines():
        if line.strip() and json.loads(line).get("step", 0) <= resume_step:
          self.records.append(json.loads(line))

  def write(self, record: dict):
    if self.path:
      self.records.append(record)
      tmp = self.path.parent / (self.path.name + ".tmp")
      tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
      tmp.replace(self.path)


def train(cfg, workdir: str | None) -> dict:
  """Trains per the config; resumes from WORKDIR's latest checkpoint. Returns the last record."""
  run = setup(cfg, workdir)
  with jax.set_mesh(run.mesh):
    return _train(run)


def opt_shardings(run: Run, tx):
  abstract = jax.eval_shape(tx.init, run.params)
  specs = sharding.like_params(abstract, sharding.param_specs_of(run.param_shardings),
                               run.params)
  return sharding.named(run.mesh, specs)


def _train(run: Run) -> dict:
  cfg, workdir = run.cfg, run.workdir
  t_start = time.time()
  if workdir and _is_main():
    ckpt_lib.write_config(workdir, cfg)
  tx = optim.make(cfg, run.num_iterations, run.hp)
  o_sh = opt_shardings(run, tx)
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(run.params)
  params = run.params
  T = cfg.model.sequence_len
  it = data_lib.train_batches(run.train_docs, run.tok, T + 1, run.rows, seed=cfg.train.seed)
  ckpts = ckpt_lib.TrainCheckpoints(workdir, keep=cfg.train.keep_checkpoints) if workdir else None
  step = 0
  if ckpts is not None:
    abstract_p = jax.tree.map(ocp_abstract, params)
    abstract_o = jax.tree.map(ocp_abstract, opt_state)
    restored = ckpts.restore(abstract_p, abstract_o, it, log=log)
    if restored is not None:
      step, params, opt_state, _ = restored
      log(f"resumed from {ckpt_lib.checkpoint_dir(workdir)}/{step}")
  metrics = Metrics(workdir, step)
  evaluator = Evaluator(run)
  batch_sh = sharding.batch_sharding(run.mesh, leading_dims=2)
  step_fn = jax.jit(make_train_step(run.graphdef, tx),
                    in_shardings=(run.param_shardings, o_sh, batch_sh, batch_sh),
                    out_shardings=(run.param_shardings, o_sh, None),
                    donate_argnums=(0, 1))
  N = run.num_iterations
  tokens_per_step = cfg.train.batch_tokens
  peak = plan_lib.peak_flops() * jax.device_count()
  log(f"bov_jax: {model_lib.describe(cfg)} | {N} steps x {tokens_per_step:,} tokens "
      f"(accum {run.accum}) | {jax.device_count()} {jax.devices()[0].platform} device(s)")
  stop = _Stop()
  last = {}
  if step == 0:
    val = evaluator(params)
    last = {"step": 0, "val_bpb": val, "tokens": 0}
    metrics.write(last)
    log(f"step 0 | val_bpb {val:.4f}")
  last_good = ckpts.latest_step() if ckpts else None
  t_window, steps_window = time.time(), 0
  while step < N:
    local = np.stack([next(it) for _ in range(run.accum)])  # [A, rows, T+1]
    x = sharding.global_batch(local[:, :, :-1], run.mesh, leading_dims=2)
    y = sharding.global_batch(local[:, :, 1:], run.mesh, leading_dims=2)
    lr_mult = float(optim.lr_multiplier(step, N, cfg.optim.warmup_steps,
                                        cfg.optim.warmdown_ratio, cfg.optim.final_lr_frac))
    params, opt_state, out = step_fn(params, opt_state, x, y)
    step += 1
    steps_window += 1
    loss = float(out["train_loss"])
    if not math.isfinite(loss):
      where = (f"{ckpt_lib.checkpoint_dir(workdir)}/{last_good}" if last_good is not None
               else "none (no checkpoint was written)")
      raise TrainError(f"train_loss is {loss} at step {step}; stopping. "
                       f"Last good checkpoint: {where}")
    record = {"step": step, "train_loss": loss, "lr": lr_mult, "tokens": step * tokens_per_step}
    evaluate = step % cfg.train.eval_every == 0 or step == N
    if evaluate:
      record["val_bpb"] = evaluator(params)
    every = cfg.eval.core_every
    if cfg.eval.core_bundle and every > 0 and (step % every == 0 or step == N):
      record["core"] = run_core(run, params)["core"]
    if step % cfg.train.log_every == 0 or evaluate or step == N:
      dt = time.time() - t_window
      tps = steps_window * tokens_per_step / max(dt, 1e-9)
      record["tokens_per_s"] = tps
      record["mfu"] = tps * run.flops_per_token / peak
      metrics.write(record)
      eta = (N - step) * tokens_per_step / max(tps, 1e-9)
      log(f"step {step}/{N} | loss {loss:.4f} | lr x{lr_mult:.3f} | {tps:,.0f} tok/s | "
          f"mfu {100 * record['mfu']:.1f}% | eta {_fmt_time(eta)}"
          + (f" | val_bpb {record['val_bpb']:.4f}" if "val_bpb" in record else ""))
      t_window, steps_window = time.time(), 0
    last = record
    if ckpts is not None and (step % cfg.train.checkpoint_every == 0 or step == N
                              or stop.requested):
      ckpts.save(step, params, opt_state, it, {"step": step, "train_loss": loss},
                 force=stop.requested or step == N)
      last_good = step
    if stop.requested:
      ckpts and ckpts.close()
      log(f"SIGTERM: checkpointed step {step}; exiting")
      sys.exit(143)
  if ckpts is not None:
    ckpts.close()
  if cfg.train.sample_tokens > 0:  # every process runs the jitted steps; process 0 prints
    prompt = run.tok.encode("def ")
    ids = inference.generate_uncached(run.graphdef, params, prompt, cfg.train.sample_tokens,
                                      cfg.model.sequence_len, temperature=0.0)
    log("sample: " + repr(run.tok.decode(prompt[1:] + ids)))
  if workdir and _is_main():
    from etils import epath
    (epath.Path(workdir) / "DONE").write_text(json.dumps(last))  # sweeps skip finished runs
  log(f"done in {_fmt_time(time.time() - t_start)}")
  return last


def ocp_abstract(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


# -- --mode=eval -----------------------------------------------------------------------------

def evaluate_checkpoint(cfg, workdir: str) -> dict:
  """Validation bpb of WORKDIR's latest checkpoint."""
  if not workdir:
    raise TrainError("--mode=eval needs --workdir=DIR holding a checkpoint")
  run = setup(cfg, workdir)
  with jax.set_mesh(run.mesh):
    return _evaluate_checkpoint(run, workdir)


def restore_params(run: Run, workdir: str):
  """(step, params) of WORKDIR's newest readable checkpoint, sharded like run.params."""
  mgr = ckpt_lib.manager(workdir, async_save=False)
  steps = sorted(mgr.all_steps())
  if not steps:
    raise TrainError(f"no checkpoint under {ckpt_lib.checkpoint_dir(workdir)}")
  import orbax.checkpoint as ocp
  abstract = jax.tree.map(ocp_abstract, run.params)
  for step in reversed(steps):
    try:
      out = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
      return step, out["params"]
    except Exception as e:  # noqa: BLE001 - fall back past an unreadable step, loudly
      log(f"warning: checkpoint {step} is unreadable ({type(e).__name__}); trying the previous one")
  raise TrainError(f"no readable checkpoint under {ckpt_lib.checkpoint_dir(workdir)}")


def _evaluate_checkpoint(run: Run, workdir: str) -> dict:
  step, params = restore_params(run, workdir)
  if run.cfg.eval.core_bundle:
    result = {"step": int(step), **run_core(run, params)}
    name = "core.json"
  else:
    result = {"step": int(step), "val_bpb": Evaluator(run)(params)}
    name = "eval.json"
  if _is_main():
    from etils import epath
    (epath.Path(workdir) / name).write_text(json.dumps(result))
  return result


def sample_checkpoint(cfg, workdir: str) -> dict:
  """--mode=sample: text from WORKDIR's latest checkpoint (config.sample settings)."""
  if not workdir:
    raise TrainError("--mode=sample needs --workdir=DIR holding a checkpoint")
  run = setup(cfg, workdir)
  s = cfg.sample
  with jax.set_mesh(run.mesh):
    _, params = restore_params(run, workdir)
    prompt = run.tok.encode(s.prompt)
    context = cfg.model.sequence_len
    if len(prompt) >= context:
      raise config_lib.ConfigError(f"sample.prompt is {len(prompt)} tokens; the context is "
                                   f"{context}")
    graphdef = run.graphdef
    if s.tables_on_host:
      graphdef, params = inference.tables_to_host(cfg, params)
    gen = inference.generate_cached if s.use_cache else inference.generate_uncached
    ids = gen(graphdef, params, prompt, s.max_new_tokens, context, s.temperature, s.top_k, s.seed)
  log(run.tok.decode(prompt[1:] + ids))
  return {"tokens": ids}


def run_core(run: Run, params) -> dict:
  from bov_jax import evaluate
  cfg = run.cfg
  return evaluate.core(cfg.eval.core_bundle, run.graphdef, params, run.tok,
                       cfg.model.sequence_len, cfg.eval.core_max_per_task, log=log)
