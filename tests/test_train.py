"""The train loop end to end: bpb, resume exactness, corrupt checkpoints, NaN stop, eval mode."""
import json
import math
import os
import pathlib
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bov_jax.data import batches as data_lib
from bov_jax.evaluation import bpb
from bov_jax.host import process
from bov_jax.training import step as step_lib
from tests.helpers import TINY_RUN
from tests.helpers import command
from tests.helpers import command_env
from tests.helpers import init_model
from tests.helpers import small_config
from tests.helpers import start

FAST = ["--config=configs/tiny.py", *TINY_RUN, "--config.train.sample_tokens=8",
        "--config.train.log_every=1"]


def _main(workdir, *extra, timeout=600, env=None, fast=True):
  return command("main", f"--workdir={workdir}", *(FAST if fast else []), *extra, devices=1,
                 env=env, timeout=timeout)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_bits_per_byte_by_hand():
  cfg = small_config("gpt_base_v_from_value_emb_learn")
  m = init_model(cfg, jax.random.key(0))
  graphdef, state = nnx.split(m)
  params = nnx.to_pure_dict(state)
  idx = np.random.default_rng(0).integers(0, 100, (2, 9)).astype(np.int32)
  x, y = idx[:, :-1], idx[:, 1:].copy()
  y[1, 3] = -1
  token_bytes = np.random.default_rng(1).integers(0, 4, 100).astype(np.int32)  # some zero
  nats, nbytes = step_lib.make_eval_step(graphdef)(params, x, y, jnp.asarray(token_bytes))
  logits = np.asarray(m(jnp.asarray(x)), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want_nats = want_bytes = 0.0
  for b in range(2):
    for t in range(8):
      if y[b, t] >= 0 and token_bytes[y[b, t]] > 0:
        want_nats -= logp[b, t, y[b, t]]
        want_bytes += token_bytes[y[b, t]]
  assert float(nbytes) == want_bytes
  assert float(nats) == pytest.approx(want_nats, rel=1e-5)
  assert bpb.bits_per_byte(nats, nbytes) == pytest.approx(want_nats / (math.log(2) * want_bytes),
                                                            rel=1e-5)


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(tmp_path):
  """A run killed with SIGKILL and run again ends as the uninterrupted run. The killed run
  also traces steps 5-6 (log.profile_steps): the trace is there, and every loss before
  the kill is the untraced run's."""
  full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
  args = ["--config.train.num_iterations=40", "--config.train.checkpoint_every=10",
          "--config.train.eval_every=20", "--config.sample.prompt=import"]
  out = _main(full, *args)
  assert out.returncode == 0, out.stderr[-3000:]
  # the same command, traced, killed with SIGKILL after step 25, then run again
  args_b = [*args, "--config.log.profile_start_step=5", "--config.log.profile_steps=2"]
  proc = start("main", f"--workdir={killed}", *FAST, *args_b, devices=1)
  for line in proc.stdout:
    if line.startswith("step 26/"):
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  with open(os.path.join(killed, "metrics.jsonl")) as f:
    before = f.read()
  assert list(pathlib.Path(killed, "profile").rglob("*.xplane.pb"))
  losses = lambda rs: {r["step"]: r["train_loss"] for r in rs if "train_loss" in r}
  traced, untraced = losses(_metrics(killed)), losses(_metrics(full))
  assert len(traced) >= 25 and all(traced[k] == untraced[k] for k in traced)
  out = _main(killed, *args_b)
  assert out.returncode == 0, out.stderr[-3000:]
  resumed = re.search(r"resumed from \S*/checkpoints/(\d+)", out.stdout)
  assert resumed and int(resumed.group(1)) in (10, 20)  # 10 if step 20's async save was cut
  saved = int(resumed.group(1))
  a, b = _metrics(full), _metrics(killed)
  last_a = [r for r in a if r["step"] == 40][0]
  last_b = [r for r in b if r["step"] == 40][0]
  assert last_b["train_loss"] == pytest.approx(last_a["train_loss"], rel=1e-5)
  assert last_b["val_bpb"] == pytest.approx(last_a["val_bpb"], rel=1e-5)
  assert [r["step"] for r in b] == [r["step"] for r in a]  # one run's worth of lines
  with open(os.path.join(killed, "metrics.jsonl")) as f:  # appended after step 20's line
    assert f.read().startswith(before[:before.index(f'{{"step": {saved + 1},')])
  # and it learns: validation bpb falls
  assert last_a["val_bpb"] < 0.85 * a[0]["val_bpb"]
  for key in ("step", "train_loss", "lr", "tokens"):
    assert key in a[5]
  assert "sample: 'import" in out.stdout  # the end-of-run sample continues sample.prompt
  # live tracking: TensorBoard event files in the run directory
  from tests.helpers import read_events
  tags = read_events(full)
  for tag in ("train/loss", "train/lr", "val/bpb", "perf/tokens_per_s", "perf/mfu"):
    assert tags.get(tag), tag
  assert [s for s, _ in tags["val/bpb"]] == [0, 20, 40]
  assert "compile_s" in a[1] and "tokens_per_s" not in a[1]  # step 1: compilation, apart
  # --mode=eval reads the run's config and latest checkpoint; prints a JSON last line
  ev = _main(full, "--mode=eval", fast=False)
  assert ev.returncode == 0, ev.stderr[-2000:]
  res = json.loads(ev.stdout.strip().splitlines()[-1])
  assert res["step"] == 40 and res["val_bpb"] == pytest.approx(last_a["val_bpb"], rel=1e-4)
  # CORE: the authors' 21 tasks with their shots (the bundle's own core.yaml is ignored)
  from tests.helpers import write_authors_bundle
  write_authors_bundle(tmp_path / "bundle")
  ev = _main(full, "--mode=eval", f"--config.eval.core_bundle={tmp_path / 'bundle'}",
             "--config.eval.core_max_per_task=2", fast=False)
  assert ev.returncode == 0, ev.stderr[-2000:]
  res = json.loads(ev.stdout.strip().splitlines()[-1])
  assert len(res["core_tasks"]) == 21 and 0 <= res["core_tasks"]["copa"]["accuracy"] <= 1
  shots = {k: v["shots"] for k, v in res["core_tasks"].items()}
  assert shots["arc_easy"] == 25 and shots["winogrande"] == 5 and shots["copa"] == 0
  assert res["core"] == pytest.approx(sum(v["centered"] for v in res["core_tasks"].values()) / 21)
  # --mode=sample: 48 greedy tokens, cached and uncached, from the trained BoV checkpoint
  toks = []
  for use_cache in ("true", "false"):
    sm = _main(full, "--mode=sample", "--config.sample.max_new_tokens=48",
               f"--config.sample.use_cache={use_cache}")
    assert sm.returncode == 0, sm.stderr[-2000:]
    toks.append(json.loads(sm.stdout.strip().splitlines()[-1])["tokens"])
  assert len(toks[0]) == 48 and toks[0] == toks[1]


@pytest.mark.slow
def test_a_damaged_checkpoint_is_set_aside_and_written_again(tmp_path):
  """The same command after any damage to the newest checkpoint finishes (exit 0, DONE),
  resuming exactly from the one before: a step that does not read back whole (a missing
  optimizer file; then this process's data-iterator state) is renamed out of the way and
  written again when the run reaches it."""
  wd = str(tmp_path / "run")
  args = ["--config.train.num_iterations=20", "--config.train.checkpoint_every=10",
          "--config.train.eval_every=100", "--config.train.sample_tokens=0"]
  out = _main(wd, *args)
  assert out.returncode == 0, out.stderr[-2000:]
  first = {r["step"]: r["train_loss"] for r in _metrics(wd) if "train_loss" in r}
  ckpts = pathlib.Path(wd, "checkpoints")
  largest = lambda d: max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  damage = [lambda: largest(ckpts / "20" / "opt").unlink(),  # one of its data files
            lambda: next((ckpts / "20" / "data").glob("process_0-of-1.json")).unlink()]
  for n, harm in enumerate(damage):
    harm()
    if n == 0:  # and the log's last append torn, as a crash mid-write leaves it
      with open(os.path.join(wd, "metrics.jsonl"), "a") as f:
        f.write('{"step": 21, "train_lo')
    out = _main(wd, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("metrics.jsonl: cut 22 bytes of a torn last line" in out.stdout) == (n == 0)
    aside = f"checkpoints/20.damaged{'.1' if n else ''}"
    assert "checkpoints/20 does not read back whole" in out.stdout and aside in out.stdout
    assert "Traceback" not in out.stderr and "never retrieved" not in out.stderr, out.stderr
    assert re.search(r"resumed from \S*/checkpoints/10\b", out.stdout), out.stdout
    assert (ckpts / aside.split("/")[1]).is_dir() and (ckpts / "20" / "opt").is_dir()
    assert pathlib.Path(wd, "DONE").exists()
    again = {r["step"]: r["train_loss"] for r in _metrics(wd) if "train_loss" in r}
    assert sorted(again) == sorted(first)  # one run's worth of records
    assert again[20] == pytest.approx(first[20], rel=1e-5)  # the resume is exact
  # scrambled parameters at 20, and a longer run: it resumes from 10 and goes on
  for p in (ckpts / "20" / "params").rglob("*"):
    if p.is_file():
      p.write_bytes(b"garbage")
  out = _main(wd, *args[1:], "--config.train.num_iterations=22")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "checkpoints/20 does not read back whole" in out.stdout
  assert [r["step"] for r in _metrics(wd)][-1] == 22
  # the run directory is the source of truth: a shape it cannot restore is refused by name
  out = _main(wd, "--config.model.n_layer=4")
  assert out.returncode == 2 and "model.n_layer: the run has 2, asked for 4" in out.stderr
  assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_compile_cache_dir_keeps_the_compiled_step(tmp_path):
  """train.compile_cache_dir turns JAX's persistent cache on (where the environment does not
  name one), so a restart of the same run loads its step instead of compiling it."""
  cache = tmp_path / "xla"
  env = command_env(1, JAX_COMPILATION_CACHE_DIR=None)
  out = _main(tmp_path / "run", "--config.train.num_iterations=1", "--config.train.eval_every=100",
              "--config.train.sample_tokens=0", f"--config.train.compile_cache_dir={cache}",
              env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  assert cache.is_dir() and any(cache.iterdir()), "no executable was written to the cache"


def test_unusable_compile_cache_dir_is_named_and_skipped(monkeypatch, capsys, tmp_path):
  from bov_jax.settings import config as config_lib
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  session_cache = jax.config.jax_compilation_cache_dir  # conftest's, on in this process
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = config_lib.base_config()
    cfg.train.compile_cache_dir = str(blocker / "cache")  # under a file: cannot be made
    process.use_compile_cache(cfg.train.compile_cache_dir)
    err = capsys.readouterr().err
    assert f"train.compile_cache_dir='{blocker / 'cache'}' is unusable" in err
    assert jax.config.jax_compilation_cache_dir is None  # left off, not half on
  finally:
    jax.config.update("jax_compilation_cache_dir", session_cache)


@pytest.mark.slow
def test_nan_loss_stops_with_step_and_checkpoint(tmp_path):
  out = _main(str(tmp_path / "nan"), "--config.train.num_iterations=30",
              "--config.train.checkpoint_every=1", "--config.optim.embedding_lr=1e30",
              "--config.optim.unembedding_lr=1e30", "--config.optim.matrix_lr=1e30",
              "--config.optim.warmup_steps=1", "--config.train.eval_every=100")
  assert out.returncode == 1
  assert "train_loss is nan at step" in out.stderr or "train_loss is inf at step" in out.stderr
  assert "Last good checkpoint:" in out.stderr


def test_batch_tokens_must_divide(tmp_path):
  out = _main(str(tmp_path / "bad"), "--config.train.batch_tokens=1000")
  assert out.returncode == 2 and "train.batch_tokens=1000 must be a multiple" in out.stderr


def test_missing_corpus_is_named(tmp_path):
  out = _main(str(tmp_path / "bad"), "--config.data.corpus=/no/such/corpus.jsonl")
  assert out.returncode == 2 and "data.corpus='/no/such/corpus.jsonl'" in out.stderr


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_continues(tmp_path):
  """SIGTERM: a checkpoint, exit 75, and the same command resumes. The run also traces
  steps 2-3 (log.profile_steps) into WORKDIR/profile/, where TensorBoard's profile plugin
  reads plugins/profile/*/*.xplane.pb."""
  wd = str(tmp_path / "term")
  args = ["--config.train.num_iterations=12", "--config.train.checkpoint_every=100",
          "--config.train.eval_every=100", "--config.train.sample_tokens=0",
          "--config.log.profile_steps=2", "--config.log.profile_start_step=2"]
  proc = start("main", f"--workdir={wd}", *FAST, *args, devices=1)
  for line in proc.stdout:
    if line.startswith("step 4/"):
      proc.send_signal(signal.SIGTERM)
      break
  rest = proc.communicate(timeout=120)[0]
  assert proc.returncode == 75, rest[-2000:]  # preempted: run the same command again
  m = [line for line in rest.splitlines() if line.startswith("preempted: checkpointed step")]
  assert m, rest[-2000:]
  step = int(m[0].split("step ")[1].split(";")[0])
  assert step >= 4 and os.path.isdir(os.path.join(wd, "checkpoints", str(step)))
  traces = list(pathlib.Path(wd, "profile").rglob("*.xplane.pb"))
  assert traces and traces[0].parent.parent.name == "profile", traces
  assert traces[0].stat().st_size > 0
  out = _main(wd, *args)
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"checkpoints/{step}" in out.stdout
  assert [r["step"] for r in _metrics(wd) if "train_loss" in r] == list(range(1, 13))


def test_config_and_workdir_errors_are_named(tmp_path):
  out = _main(tmp_path / "new", fast=False)  # no --config and no run to read one from
  assert out.returncode != 0 and "--config=FILE is required" in out.stderr
  f = tmp_path / "a_file"
  f.write_text("")
  for fast in (True, False):  # with --config, and reading the run directory's
    out = _main(f, fast=fast)
    assert out.returncode == 2 and "is a file; expected a directory" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("flag, says", [
    ("--config.optim.matrix_lr=-0.02", "optim.matrix_lr=-0.02: expected a number >= 0"),
    ("--config.optim.warmdown_ratio=3", "optim.warmdown_ratio=3.0: expected a number in [0, 1]"),
    ("--config.optim.warmup_steps=-1", "optim.warmup_steps=-1: expected an integer >= 0"),
    ("--config.model.vocab_size=200", "model.vocab_size=200 must be at least 265"),
    ("--config.train.num_iterations=abc", "--config.train.num_iterations=abc: invalid literal"),
    ("--config.train.num_iteratons=5", "--config.train.num_iteratons=5: no such setting (did "
     "you mean num_iterations?)")])
def test_a_bad_setting_exits_2_in_one_line_and_writes_nothing(tmp_path, flag, says):
  wd = tmp_path / "run"
  out = _main(wd, flag)
  lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert out.returncode == 2 and lines and says in lines[0], out.stderr[-2000:]
  assert "Traceback" not in out.stderr and not wd.exists()



@pytest.mark.slow
def test_one_run_owns_a_run_directory(tmp_path):
  """A second training run on a live run's directory stops at once with one line naming
  the directory and the holder, and writes nothing there (a setting it changes is not
  recorded); once the holder is killed with SIGKILL, the same command takes over and
  finishes."""
  import time
  wd = str(tmp_path / "run")
  args = ["--config.train.num_iterations=400", "--config.train.eval_every=1000",
          "--config.train.sample_tokens=0"]
  holder = start("main", f"--workdir={wd}", *FAST, *args, devices=1)
  try:
    for line in holder.stdout:
      if line.startswith("step 2/"):
        break
    t0 = time.monotonic()
    out = _main(wd, *args, "--config.train.log_every=5")
    assert out.returncode == 2 and time.monotonic() - t0 < 60, out.stderr[-2000:]
    error = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(error) == 1 and error[0].startswith(f"error: --workdir={wd} is in use"), error
    assert f"pid {holder.pid}" in error[0]
    assert not os.path.exists(os.path.join(wd, "config_changes.jsonl"))
  finally:
    holder.kill()
    holder.wait(timeout=60)
  out = _main(wd, "--config.train.num_iterations=12", "--config.train.eval_every=1000",
              "--config.train.sample_tokens=0")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "taking over from a run that ended without releasing it" in out.stdout
  assert os.path.exists(os.path.join(wd, "DONE")) and not os.path.exists(os.path.join(wd, "LOCK"))


def _parquet_corpus(d, n_files=3, docs=2200):
  """Shards of short random documents, row groups of 50: 22 windows of the training
  shards an epoch, more than a run reads ahead before its first step (the packer's
  buffer, the chunks tokenized ahead, the window read ahead: about ten)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9)))
           for _ in range(3000)]
  d.mkdir(parents=True)
  for k in range(n_files):
    texts = [f"Document {k}.{i}. " + " ".join(rng.choice(words, 5)) for i in range(docs)]
    pq.write_table(pa.table({"text": texts}), d / f"shard_{k:05d}.parquet", row_group_size=50,
                   compression="snappy")


@pytest.mark.slow
def test_a_bad_corpus_file_is_named_before_or_during_training(tmp_path):
  """A shard without its footer exits 2 naming it, before anything is written; a row group
  that cannot be read mid-run stops the run at a checkpoint (exit 1) naming the file and
  the group, and the same command, once the file is mended, finishes as the run would have."""
  from bov_jax.data import corpus
  from tests.helpers import corrupt_row_group
  good, bad = tmp_path / "good", tmp_path / "bad"
  _parquet_corpus(good)
  bad.mkdir()
  for p in good.iterdir():
    (bad / p.name).write_bytes(p.read_bytes())
  args = [f"--config.data.corpus={bad}", "--config.data.tokenizer_chars=20000",
          "--config.train.num_iterations=120", "--config.train.checkpoint_every=50",
          "--config.train.eval_every=200", "--config.train.log_every=10",
          "--config.train.sample_tokens=0"]
  shard = bad / "shard_00001.parquet"
  shard.write_bytes(shard.read_bytes()[:-100])
  out = _main(tmp_path / "early", *args)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines() == [
      f"error: data.corpus: {shard} is not a readable Parquet file (Parquet magic bytes not "
      "found in footer. Either the file is corrupted or this is not a parquet file.)"]
  assert not (tmp_path / "early").exists()
  # a row group of the first epoch's last window: read well after the first step
  shard.write_bytes((good / shard.name).read_bytes())
  train, _ = corpus.split(corpus.open_corpus(str(good)), "auto", 1, 3)
  windows = data_lib.TrainWindows(train, None, 0)
  late = next(int(g) for g in windows.groups(windows.per_epoch - 1) if g >= 44) - 44
  corrupt_row_group(shard, late)
  wd = tmp_path / "run"
  out = _main(wd, *args)
  assert out.returncode == 1, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  stop = re.fullmatch(rf"error: data\.corpus: {re.escape(str(shard))} row group {late} cannot be "
                      r"read \(OSError: .*\); stopped after step (\d+) \(checkpoint: \S+/(\d+)\)\. "
                      "Mend or replace that file and run the same command to resume", lines[-1])
  assert len(lines) == 1 and stop, out.stderr[-2000:]
  assert 0 < int(stop[1]) == int(stop[2]) < 120 and (wd / "checkpoints" / stop[1]).is_dir()
  print(f"stopped after step {stop[1]} of 120")
  shard.write_bytes((good / shard.name).read_bytes())
  out = _main(wd, *args)
  assert out.returncode == 0 and (wd / "DONE").exists(), out.stderr[-2000:]
  assert f"resumed from {wd}/checkpoints/{stop[1]}" in out.stdout
  whole = tmp_path / "whole"
  assert _main(whole, *args).returncode == 0
  assert _metrics(wd)[-1]["train_loss"] == pytest.approx(_metrics(whole)[-1]["train_loss"],
                                                          rel=1e-6)


def _tiny_spec(**train):
  """configs/tiny.py at the tests' shapes (TINY_RUN), resolved for this process's devices."""
  from bov_jax.run import spec as spec_lib
  from bov_jax.settings import config as config_lib
  cfg = config_lib.from_file("configs/tiny.py")
  for flag in TINY_RUN:
    key, value = flag.removeprefix("--config.").split("=")
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    node[leaf] = type(node[leaf])(value)
  cfg.train.update(dict(sample_tokens=0, log_every=1, **train))
  return spec_lib.resolve(cfg)


def _record_loads_and_saves(monkeypatch, on_eval=None):
  """The loop's batch loads and checkpoint saves, in the order they happen, as
  ("load", steps done so far) and ("save", step). `on_eval(n)` runs at the n-th
  evaluation (the first is step 0's)."""
  from bov_jax.store import checkpoint as ckpt_lib
  from bov_jax.training import train
  events, done = [], {"steps": 0, "evals": 0}
  load, save, dispatch = train._load, ckpt_lib.Checkpoints.save, train._dispatch
  evaluate = bpb.Evaluator.__call__

  def counted_dispatch(run, state):
    done["steps"] = dispatch(run, state)
    return done["steps"]

  def counted_eval(self, params):
    done["evals"] += 1
    if on_eval:
      on_eval(done["evals"])
    return evaluate(self, params)

  monkeypatch.setattr(train, "_load", lambda run, state: (events.append(("load", done["steps"])),
                                                          load(run, state))[1])
  monkeypatch.setattr(train, "_dispatch", counted_dispatch)
  monkeypatch.setattr(bpb.Evaluator, "__call__", counted_eval)
  monkeypatch.setattr(ckpt_lib.Checkpoints, "save", lambda self, step, *a, **k: (
      events.append(("save", step)), save(self, step, *a, **k))[1])
  return events


def test_no_batch_loads_between_a_step_and_its_checkpoint(tmp_path, monkeypatch):
  """A checkpoint saves the data iterator as it is right after its step: when one is
  due, the next batch loads only once it is saved, so every checkpoint of step s follows
  exactly s loads (one batch per step) and the step after it resumes on the right batch.
  Elsewhere the next batch loads while the device runs the step (before its record)."""
  from bov_jax.training import train
  events = _record_loads_and_saves(monkeypatch)
  out = train.train(_tiny_spec(num_iterations=6, checkpoint_every=2, eval_every=3),
                    str(tmp_path / "run"))
  assert out["step"] == 6 and "preempted" not in out
  saves = [(i, step) for i, (kind, step) in enumerate(events) if kind == "save"]
  assert [step for _, step in saves] == [2, 4, 6]
  for i, step in saves:
    assert sum(kind == "load" for kind, _ in events[:i]) == step, events
  loads = [steps for kind, steps in events if kind == "load"]
  assert loads == [0, 1, 2, 3, 4, 5]  # the batch of step s+1 loads after step s is dispatched


def test_a_preemption_during_an_action_loses_nothing(tmp_path, monkeypatch):
  """SIGTERM arriving in the middle of an action (the evaluation after step 3): the actions
  already decided for that step run, the stop is agreed a step or two later, every step
  up to it is recorded and the checkpoint holds the last one; the same call then runs the
  rest, and the losses equal an uninterrupted run's."""
  from bov_jax.training import train
  spec = _tiny_spec(num_iterations=7, checkpoint_every=100, eval_every=3)
  straight = train.train(spec, str(tmp_path / "straight"))
  events = _record_loads_and_saves(
      monkeypatch, on_eval=lambda n: n == 2 and os.kill(os.getpid(), signal.SIGTERM))
  wd = tmp_path / "preempted"
  out = train.train(spec, str(wd))
  assert out.get("preempted"), out
  stopped = out["step"]
  assert 3 < stopped < 7
  assert [e for e in events if e[0] == "save"] == [("save", stopped)]
  assert [r["step"] for r in _metrics(wd) if "train_loss" in r] == list(range(1, stopped + 1))
  monkeypatch.undo()
  resumed = train.train(spec, str(wd))
  assert resumed["step"] == 7 and not resumed.get("preempted")
  assert [r["step"] for r in _metrics(wd) if "train_loss" in r] == list(range(1, 8))
  losses = {r["step"]: r["train_loss"] for r in _metrics(tmp_path / "straight") if "train_loss" in r}
  assert [r["train_loss"] for r in _metrics(wd) if "train_loss" in r] == [losses[s] for s in range(1, 8)]
  assert resumed["train_loss"] == straight["train_loss"]
