"""Transparent huge pages for the host memory XLA allocates, on CPU runs only.

XLA's CPU runtime allocates each step's temporaries afresh, and glibc serves
allocations that large with fresh mmaps, so every step first-touches them page by
page (the cost: docs/performance.md).
glibc's `malloc.hugetlb=1` tunable (glibc >= 2.35) madvises those mappings as
transparent huge pages, 512 times fewer faults. Tunables are read only when a
process starts, so `bov_jax.main` and the benchmarks re-execute themselves once
with it set.

Skipped when: the process will not compute on the CPU (JAX_PLATFORMS names another
backend, or it is unset and a TPU or GPU device is present), not Linux, the kernel
has transparent huge pages off, the tunable is already set, or BOV_HUGEPAGES=0.
"""

from __future__ import annotations

import glob
import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")


def _thp_available() -> bool:
  try:
    with open(THP_SETTING) as f:
      return "[never]" not in f.read()
  except OSError:
    return False


def cpu_only(environ=os.environ) -> bool:
  """Whether JAX will run on the CPU, judged before it starts."""
  platforms = environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def wanted(environ=os.environ) -> bool:
  return (sys.platform.startswith("linux") and environ.get("BOV_HUGEPAGES", "1") != "0"
          and TUNABLE not in environ.get("GLIBC_TUNABLES", "") and cpu_only(environ)
          and _thp_available())


def environ_with_tunable(environ=os.environ) -> dict:
  current = environ.get("GLIBC_TUNABLES", "")
  return dict(environ, GLIBC_TUNABLES=":".join(t for t in (current, f"{TUNABLE}=1") if t))


def reexec_with_huge_pages() -> None:
  """Replace this process by the same command line with the tunable set (or return)."""
  if not wanted():
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, environ_with_tunable())
