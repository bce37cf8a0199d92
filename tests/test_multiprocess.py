"""Several processes on this host (two processes of two CPU devices each, gloo collectives,
a coordinator on a free port), against one process of four devices: the step, the data
each reads, who writes, checkpoints across process counts, and preemption every process
agrees on. `pytest -k multiprocess` runs these."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import TINY_RUN
from tests.helpers import command
from tests.helpers import command_env
from tests.helpers import free_port
from tests.helpers import start

pytestmark = pytest.mark.slow  # several processes: end-to-end runs

TINY = ["--config=configs/tiny.py", *TINY_RUN, "--config.train.eval_every=100", "--config.train.checkpoint_every=100",
        "--config.train.log_every=1", "--config.train.sample_tokens=0"]


def _start(args, n: int, port: int, module="bov_jax.main"):
  """n processes of one command line (process i: JAX_PROCESS_ID=i), two devices each."""
  procs = []
  for i in range(n):
    extra = [f"--coordinator_address=localhost:{port}", f"--num_processes={n}"]
    procs.append(start(module, *args, *extra, env=command_env(2, JAX_PROCESS_ID=i),
                       stderr=subprocess.PIPE))
  return procs


def _finish(procs, timeout=300):
  outs = [p.communicate(timeout=timeout) for p in procs]
  return [p.returncode for p in procs], [o for o, _ in outs], [e for _, e in outs]


def _one_started(args, log: str, devices=4):
  """One process of `devices` devices, started, its output to files (nothing waits on a
  full pipe while another run is followed); _collect waits for it."""
  with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
    return start("main", *args, devices=devices, stdout=out, stderr=err)


def _collect(proc, log: str, timeout=300):
  """(exit code, stdout, stderr) of a process from _one_started."""
  proc.wait(timeout=timeout)
  with open(log + ".out") as out, open(log + ".err") as err:
    return proc.returncode, out.read(), err.read()


def _metrics(wd):
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_multiprocess_step_and_data_equal_one_process():
  """A train step fed the same global batch: two processes of two devices give the loss
  and parameters of one process of four (1e-5); each process reads its own row groups."""
  port = free_port()
  procs = [start("tests.mp_step", 2, i, port, devices=2, stderr=subprocess.PIPE)
           for i in range(2)]
  one = command("tests.mp_step", 1, 0, 0, devices=4, timeout=300)
  codes, outs, errs = _finish(procs)
  assert codes == [0, 0] and one.returncode == 0, (errs[0][-2000:], one.stderr[-2000:])
  got = [json.loads(o.strip().splitlines()[-1]) for o in outs]
  want = json.loads(one.stdout.strip().splitlines()[-1])
  assert [g["process"] for g in got] == [0, 1] and all(g["devices"] == 4 for g in got)
  for g in got:
    assert g["loss"] == pytest.approx(want["loss"], rel=1e-5)
    for k, v in want["params"].items():
      assert g["params"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
  a, b = set(got[0]["groups"]), set(got[1]["groups"])
  assert a and b and not a & b and len(a | b) == want["all_groups"]  # disjoint, together all
  assert set(want["groups"]) == a | b


def test_two_slices_train_as_one_device(tmp_path):
  """Two processes of two devices standing for two slices (mesh.slices=2), data or FSDP
  inside each: five steps of two micro-batches give one device's losses and parameters
  (tests/test_step.py's model and tolerances)."""
  import numpy as np

  from tests.mp_slices import LAYOUTS
  port = free_port()
  procs = [start("tests.mp_slices", 2, i, port, tmp_path, devices=2, stderr=subprocess.PIPE)
           for i in range(2)]
  one = command("tests.mp_slices", 1, 0, 0, tmp_path, devices=1, timeout=300)
  codes, _, errs = _finish(procs)
  assert codes == [0, 0] and one.returncode == 0, (errs[0][-2000:], one.stderr[-2000:])
  want = np.load(tmp_path / "1x1x1.npz")
  for shape in LAYOUTS:
    got = np.load(tmp_path / ("x".join(map(str, shape)) + ".npz"))
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
    for k in want.files:
      a, b = got[k].astype(np.float64), want[k].astype(np.float64)
      assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b), (shape, k)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  """A small corpus and one tokenizer for every run here (each would train the same one)."""
  from bov_jax.data import corpus
  from bov_jax.data import tokenizer as tok_lib
  d = tmp_path_factory.mktemp("data")
  docs = corpus.embedded_documents()[:3000]
  (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
  tok_lib.train(tok_lib.training_texts(docs, 2_000_000), 512).save(str(d / "tok"))
  return [f"--config.data.tokenizer={d}/tok", f"--config.data.corpus={d}/corpus.jsonl"]


@pytest.mark.parametrize("slices", [1, 2])
def test_multiprocess_training_checkpoints_across_process_counts_and_preemption(tmp_path,
                                                                               tokenizer,
                                                                               slices):
  """Two processes (with slices=2, each a slice) train, resume one process's checkpoint
  and are resumed by one process; a signal to one process (one slice) stops both at one
  checkpoint."""
  two, one, pre = (str(tmp_path / n) for n in ("two", "one", "pre"))
  steps = ["--config.train.num_iterations=12", *tokenizer]
  apart = [f"--config.mesh.slices={slices}"]  # the two-process runs' only difference
  # two processes train, as one command line each; only process 0 writes and prints. Side
  # by side (independent runs, each waits on its own), one process of four devices trains
  # the same.
  started = _start([f"--workdir={two}", *TINY, *steps, *apart], 2, free_port())
  alone = _one_started([f"--workdir={one}", *TINY, *steps], one)
  codes, outs, errs = _finish(started)
  assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
  assert "step 12/12" in outs[0] and "step" not in outs[1]
  m2 = _metrics(two)
  assert [r["step"] for r in m2] == list(range(13))  # one line per step, not one per process
  events = [f for f in os.listdir(two) if f.startswith("events.out.tfevents")]
  assert len(events) == 1
  assert os.listdir(os.path.join(two, "checkpoints")) == ["12"]
  # the one-process run: validation bpb within noise of the two-process run
  code, _, err = _collect(alone, one)
  assert code == 0, err[-3000:]
  m1 = _metrics(one)
  assert m1[-1]["val_bpb"] == pytest.approx(m2[-1]["val_bpb"], rel=0.03)
  # the two-process checkpoint resumes in one process, and the one-process one in two
  # (side by side again)
  more = ["--config.train.num_iterations=14", *tokenizer]
  alone = _one_started([f"--workdir={two}", *TINY, *more], two)
  codes, outs, errs = _finish(_start([f"--workdir={one}", *TINY, *more, *apart], 2,
                                     free_port()))
  assert codes == [0, 0] and "resumed from" in outs[0], errs[0][-3000:]
  assert _metrics(one)[-1]["step"] == 14
  code, out, err = _collect(alone, two)
  assert code == 0 and "resumed from" in out, err[-3000:]
  assert _metrics(two)[-1]["step"] == 14
  # SIGTERM to process 1 alone: both stop after the same step, one checkpoint, exit 75
  procs = _start([f"--workdir={pre}", *TINY, *steps, *apart], 2, free_port())
  for line in procs[0].stdout:
    if line.startswith("step 2/"):
      procs[1].send_signal(signal.SIGTERM)
      t0 = time.time()
      break
  codes, outs, errs = _finish(procs)
  assert codes == [75, 75], errs[0][-2000:] + errs[1][-2000:]
  (saved,) = os.listdir(os.path.join(pre, "checkpoints"))
  stopped = int(saved)
  assert f"preempted: checkpointed step {stopped}" in outs[0]
  assert 2 < stopped <= 2 + 3  # within the step in flight and the next (read one step late)
  print(f"stopped at step {stopped}, {time.time() - t0:.1f} s after the signal")
  # the same command resumes, and the losses are the uninterrupted run's
  codes, outs, errs = _finish(_start([f"--workdir={pre}", *TINY, *steps, *apart], 2,
                                     free_port()))
  assert codes == [0, 0] and f"checkpoints/{stopped}" in outs[0], errs[0][-3000:]
  want = {r["step"]: r for r in m2}
  for r in _metrics(pre):
    if "train_loss" in r:
      assert r["train_loss"] == pytest.approx(want[r["step"]]["train_loss"], rel=1e-5), r["step"]
