"""A run in a bucket (a GCS emulator): corpus, checkpoints, metrics, event files, tokenizer,
eval and sample modes, a sweep and a report, all on gs://; and appending to a bucket file."""
import json
import signal

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bov_jax.data import corpus
from bov_jax.store import storage
from tests.helpers import TINY_RUN
from tests.helpers import command
from tests.helpers import command_env
from tests.helpers import start

TINY = [*TINY_RUN, "--config.train.num_iterations=12", "--config.train.eval_every=6",
        "--config.train.checkpoint_every=4", "--config.train.log_every=1",
        "--config.train.sample_tokens=0", "--config.data.corpus=gs://bov/corpus"]


def _run(module, *args, env, timeout=600):
  return command(module, *args, env=env, timeout=timeout)


def _metrics(fs, path):
  return [json.loads(line) for line in fs.cat(path).decode().splitlines() if line.strip()]


def test_appending_to_a_bucket_file(gcs):
  path = "gs://bov/append/metrics.jsonl"
  for i in range(3):
    storage.append_text(path, f"line {i}\n")
  fs = fsspec.filesystem("gs")
  assert fs.cat(path) == b"line 0\nline 1\nline 2\n"
  assert fs.ls("gs://bov/append") == ["bov/append/metrics.jsonl"]  # no part left behind


@pytest.mark.slow
def test_a_tiny_run_lives_in_the_bucket(gcs, tmp_path):
  env = command_env(1, **gcs)
  fs = fsspec.filesystem("gs")
  docs = corpus.embedded_documents()
  for k in range(3):  # nanochat's layout: the last shard is the validation split
    pq.write_table(pa.table({"text": list(docs[k * 600:(k + 1) * 600])}),
                   tmp_path / f"shard_{k:05d}.parquet", row_group_size=100)
    fs.put(str(tmp_path / f"shard_{k:05d}.parquet"), f"gs://bov/corpus/shard_{k:05d}.parquet")
  # a two-point sweep, each point a run in the bucket
  sweep = tmp_path / "two.py"
  sweep.write_text("from bov_jax.jobs.sweep import from_presets\n\ndef get_sweep():\n  return "
                   "from_presets('configs/tiny.py', [('base', 'gpt_base'), "
                   "('bov', 'gpt_base_v_from_value_emb_learn')])\n")
  out = _run("bov_jax.sweep", f"--sweep={sweep}", "--local", "--workdir_root=gs://bov/sweep",
             *TINY, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  for name in ("base", "bov"):
    root = f"gs://bov/sweep/{name}"
    for part in ("config.json", "DONE", "metrics.jsonl", "tokenizer/tokenizer.pkl",
                 "checkpoints/12"):
      assert fs.exists(f"{root}/{part}"), f"{root}/{part}"
    assert fs.glob(f"{root}/events.out.tfevents.*")
    (log,) = fs.glob(f"{root}/log.*.txt")  # the point's output, kept with its run
    assert "step 12/12" in fs.cat(log).decode()
  # the same run killed (SIGKILL) mid-way and restarted resumes to the same losses
  args = ["--config=configs/tiny.py", "--workdir=gs://bov/killed",
          "--config.model.value.preset=gpt_base_v_from_value_emb_learn", *TINY]
  proc = start("main", *args, env=env)
  for line in proc.stdout:
    if line.startswith("step 10/"):
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  out = _run("bov_jax.main", *args, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from gs://bov/killed/checkpoints/" in out.stdout  # 4 or 8: saves are async
  want = {r["step"]: r for r in _metrics(fs, "gs://bov/sweep/bov/metrics.jsonl")}
  got = _metrics(fs, "gs://bov/killed/metrics.jsonl")
  assert [r["step"] for r in got] == sorted(want)
  for r in got:
    for key in ("train_loss", "val_bpb"):
      if key in r:
        assert r[key] == pytest.approx(want[r["step"]][key], rel=1e-6), (r["step"], key)
  # eval and sample read the run's config, tokenizer and checkpoint from the bucket
  ev = _run("bov_jax.main", "--workdir=gs://bov/sweep/bov", "--mode=eval", env=env)
  assert ev.returncode == 0, ev.stderr[-2000:]
  assert json.loads(ev.stdout.strip().splitlines()[-1])["val_bpb"] == pytest.approx(
      want[12]["val_bpb"], rel=1e-5)
  assert fs.exists("gs://bov/sweep/bov/eval.json")
  sm = _run("bov_jax.main", "--workdir=gs://bov/sweep/bov", "--mode=sample",
            "--config.sample.max_new_tokens=5", env=env)
  assert sm.returncode == 0 and len(json.loads(sm.stdout.strip().splitlines()[-1])["tokens"]) == 5
  # a report of both runs, written to the bucket
  rep = _run("bov_jax.report", "gs://bov/sweep/base", "gs://bov/sweep/bov",
             "--out=gs://bov/report", env=env)
  assert rep.returncode == 0, rep.stderr[-2000:]
  assert "gpt_base_v_from_value_emb_learn" in fs.cat("gs://bov/report/results.md").decode()
  assert fs.exists("gs://bov/report/val_bpb.png")
