"""Transparent huge pages for the host memory XLA allocates.

XLA's CPU runtime allocates each step's temporaries afresh (about 340 MB a step
at the issue's benchmark shape) and glibc serves allocations that large with
fresh mmaps, so every step first-touches them page by page: 85,000 page faults
and about 70 ms of kernel time a step on the 2-core benchmark host, 10% of the
step (docs/performance.md). glibc's `malloc.hugetlb=1` tunable (glibc >= 2.35)
madvises those mappings as transparent huge pages, 512 times fewer faults.
Tunables are read only when a process starts, so the entry points
(`bov_jax.main`, `bov_jax.bench`) re-execute themselves once with it set.

Skipped when: not Linux, the kernel has transparent huge pages off, the
tunable is already set, or BOV_HUGEPAGES=0.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_available() -> bool:
  try:
    with open(THP_SETTING) as f:
      return "[never]" not in f.read()
  except OSError:
    return False


def wanted(environ=os.environ) -> bool:
  return (sys.platform.startswith("linux") and environ.get("BOV_HUGEPAGES", "1") != "0"
          and TUNABLE not in environ.get("GLIBC_TUNABLES", "") and _thp_available())


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
