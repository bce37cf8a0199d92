"""host/hugepages.py: the entry points re-execute once with glibc's huge-page tunable set."""
import os
import subprocess
import sys

import pytest

from bov_jax.host import hugepages

PROBE = ("import os; from bov_jax.host import hugepages; hugepages.reexec_with_huge_pages(); "
         "print('TUNABLES=' + os.environ.get('GLIBC_TUNABLES', ''))")


def _run(env):
  out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       timeout=60, env=env)
  assert out.returncode == 0, out.stderr
  return [line for line in out.stdout.splitlines() if line.startswith("TUNABLES=")]


@pytest.mark.skipif(not hugepages.wanted({"PATH": ""}), reason="no transparent huge pages here")
def test_reexec_sets_the_tunable_once_and_keeps_others():
  env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.arena_max=2")
  env.pop("BOV_HUGEPAGES", None)
  lines = _run(env)
  assert lines == ["TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"]


def test_opt_out_and_already_set_do_not_reexec():
  env = dict(os.environ, BOV_HUGEPAGES="0")
  env.pop("GLIBC_TUNABLES", None)
  assert _run(env) == ["TUNABLES="]
  assert not hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
  assert hugepages.environ_with_tunable({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_only_cpu_runs_reexec():
  """The tunable is for XLA's CPU runtime: a process that will run on an accelerator
  (named by JAX_PLATFORMS, or found as a device when it is unset) is left alone."""
  assert hugepages.cpu_only({"JAX_PLATFORMS": "cpu"})
  assert not hugepages.cpu_only({"JAX_PLATFORMS": "tpu"})
  assert not hugepages.cpu_only({"JAX_PLATFORMS": "cuda,cpu"})
  env = dict(os.environ, JAX_PLATFORMS="tpu")
  env.pop("GLIBC_TUNABLES", None)
  env.pop("BOV_HUGEPAGES", None)
  assert not hugepages.wanted(env)
  probe = ("import os; from bov_jax.host import hugepages; hugepages.reexec_with_huge_pages(); "
           "print('TUNABLES=' + os.environ.get('GLIBC_TUNABLES', ''))")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60, env=env)
  assert "TUNABLES=\n" in out.stdout + "\n" and "hugetlb" not in out.stdout
