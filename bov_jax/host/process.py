"""What a process sets up before a mode runs (JAX's compilation cache), the one place
that says who prints, and what the processes of a run hand each other."""

from __future__ import annotations

import os
import pickle
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils


def is_main() -> bool:
  return jax.process_index() == 0


def log(msg: str) -> None:
  """A progress line, from process 0 only."""
  if is_main():
    print(msg, flush=True)


def allgather(share) -> list:
  """Every process's `share` (any picklable value), in process order, on every process.
  JAX gathers arrays, not Python values: each travels pickled, as bytes padded to the
  longest."""
  if jax.process_count() == 1:
    return [share]
  data = np.frombuffer(pickle.dumps(share), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray(data.size, np.int64)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  every = np.asarray(multihost_utils.process_allgather(padded))
  return [pickle.loads(every[p, :n].tobytes()) for p, n in enumerate(sizes)]


def use_compile_cache(path: str) -> None:
  """Turns on JAX's persistent compilation cache at `path` (train.compile_cache_dir), so
  that a restart, a resume or a sweep's next run of the same step loads the executable
  instead of compiling it again (minutes for a large model on a pod). JAX reads
  JAX_COMPILATION_CACHE_DIR itself; when that is set, it wins."""
  if not path or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  path = os.path.expanduser(path)
  if "://" not in path:  # a local directory: make it, and say once if it cannot be used
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      print(f"warning: train.compile_cache_dir={path!r} is unusable ({e}); compiling without "
            "the cache", file=sys.stderr)
      return
  jax.config.update("jax_compilation_cache_dir", path)
