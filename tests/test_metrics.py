"""What a run records: metrics.jsonl appended, TensorBoard tags, tokens/s and MFU."""
import glob
import json
import time

import ml_collections
import pytest

from bov_jax.store import metrics
from tests.helpers import read_events

LOG = ml_collections.ConfigDict({"tensorboard": True, "wandb_project": "", "wandb_entity": ""})


def test_writer_appends_and_a_resume_cuts_what_it_repeats(tmp_path):
  w = metrics.Writer(str(tmp_path), 0, LOG, {})
  for step in range(1, 6):
    w.write({"step": step, "train_loss": 10.0 - step, "lr": 0.1 * step})
  w.close()
  path = tmp_path / "metrics.jsonl"
  before = path.read_text()
  w = metrics.Writer(str(tmp_path), 3, LOG, {})  # resumed from the checkpoint of step 3
  w.write({"step": 4, "train_loss": 6.5, "lr": 0.4, "val_bpb": 1.5})
  w.close()
  after = path.read_text()
  lines = [json.loads(line) for line in after.splitlines()]
  assert [r["step"] for r in lines] == [1, 2, 3, 4]
  assert after.startswith(before[:before.index('{"step": 4')])  # earlier lines untouched
  assert lines[-1]["train_loss"] == 6.5
  events = read_events(tmp_path)
  assert events["val/bpb"] == [(4, 1.5)]
  assert {s for s, _ in events["train/loss"]} == {1, 2, 3, 4, 5}  # TensorBoard purges 4, 5


def test_no_tensorboard_when_turned_off_and_no_files_off_process_zero(tmp_path):
  off = ml_collections.ConfigDict(dict(LOG, tensorboard=False))
  w = metrics.Writer(str(tmp_path / "a"), 0, off, {})
  w.write({"step": 1, "train_loss": 1.0})
  w.close()
  assert not glob.glob(str(tmp_path / "a" / "events*"))
  w = metrics.Writer(None, 0, LOG, {})
  w.write({"step": 1, "train_loss": 1.0})  # no workdir: nothing written, no error
  w.close()


def test_wandb_is_optional_and_named(tmp_path, monkeypatch):
  """Without wandb, log.wandb_project names the extra that installs it (the train
  command prints that line and exits 1)."""
  import sys

  from bov_jax.host import extras
  monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it raises ImportError
  cfg = ml_collections.ConfigDict(dict(LOG, wandb_project="bov"))
  with pytest.raises(extras.MissingExtra,
                     match=r"log\.wandb_project needs wandb.*pip install '\.\[wandb\]'"):
    metrics.Writer(str(tmp_path), 0, cfg, {})


def test_throughput_leaves_out_excluded_time():
  t = metrics.Throughput(tokens_per_step=1000, flops_per_token=10, peak_flops=1e6)
  assert t.read() == {}  # before the clock starts (the first step compiles)
  t.begin()
  time.sleep(0.05)
  t.step_done(0.01)
  t.step_done(0.03)
  t.exclude(1000.0)  # an evaluation longer than the window
  r = t.read()
  assert r["tokens_per_s"] > 2000 * 1e6  # 2 steps over ~0 s once the excluded time is out
  assert r["data_wait_s"] == pytest.approx(0.02)
  t.step_done()
  time.sleep(0.05)
  r = t.read()
  assert 1000 / 1.0 < r["tokens_per_s"] < 1000 / 0.05 and r["mfu"] == pytest.approx(
      r["tokens_per_s"] * 10 / 1e6)


def test_a_cpu_peak_measured_low_is_measured_again():
  """A peak measured while another process shared the CPU reads low, so a window would
  read over 100% MFU: the peak is measured again, and never below what the run did."""
  calls = []
  t = metrics.Throughput(tokens_per_step=1000, flops_per_token=10, peak_flops=1.0,
                         remeasure=lambda: calls.append(1) or 5.0)
  t.begin()
  time.sleep(0.01)
  t.step_done()
  r = t.read()
  assert calls == [1] and 0 < r["mfu"] <= 1.0
  assert t.peak == pytest.approx(r["tokens_per_s"] * 10)  # the run's own rate, above 5.0
  fixed = metrics.Throughput(tokens_per_step=1000, flops_per_token=10, peak_flops=1.0)
  fixed.begin()
  fixed.step_done()
  assert fixed.read()["mfu"] > 1.0  # a datasheet peak (TPU, GPU) is left as it is
