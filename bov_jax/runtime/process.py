"""What a process sets up before a mode runs (JAX's compilation cache), and the one place
that says who prints."""

from __future__ import annotations

import os
import sys

import jax


def is_main() -> bool:
  return jax.process_index() == 0


def log(msg: str) -> None:
  """A progress line, from process 0 only."""
  if is_main():
    print(msg, flush=True)


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
