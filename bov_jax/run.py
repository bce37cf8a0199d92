"""What a process sets up before a mode runs: JAX's compilation cache, this process's
documents, the tokenizer; and the one place that says who prints.
"""

from __future__ import annotations

import os
import sys

import jax

from bov_jax import data as data_lib
from bov_jax import tokenizer as tok_lib


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


def documents(spec):
  """(training, validation) documents of this process: the fixed held-out split, each
  process reading a disjoint share of both."""
  docs = data_lib.documents(spec.data.corpus)
  pi, pc = jax.process_index(), jax.process_count()
  train = data_lib.split(docs, spec.data.val_every, "train")
  val = data_lib.split(docs, spec.data.val_every, "val")
  return data_lib.shard(train, pi, pc), data_lib.shard(val, pi, pc)


def tokenizer(spec, workdir: str | None, train_docs=None) -> tok_lib.BPETokenizer:
  """The workdir's tokenizer; where there is none, one trained on the first
  data.tokenizer_chars characters of `train_docs` (and saved in the workdir), or, with
  no documents given (evaluating or sampling a run), an error naming the file."""
  if train_docs is None:
    return tok_lib.load_from_workdir(workdir, spec.model.vocab_size)

  def texts():
    budget = spec.data.tokenizer_chars
    for i in range(len(train_docs)):
      text = train_docs[i]
      yield text[:budget]
      budget -= len(text)
      if budget <= 0:
        return

  return tok_lib.load_or_train(workdir, texts, spec.model.vocab_size)
