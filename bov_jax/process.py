"""What a process sets up before a mode runs: JAX's compilation cache, the corpus split,
the tokenizer; and the one place that says who prints.
"""

from __future__ import annotations

import os
import sys

import jax
from etils import epath

from bov_jax import corpus as corpus_lib
from bov_jax import rundir
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
  """(training, validation) splits of the corpus (corpus.Split); each process reads its
  own share of both (data.TrainWindows, Split.documents)."""
  c = corpus_lib.open_corpus(spec.data.corpus)
  n_files = len(corpus_lib.parquet_files(spec.data.corpus))
  return corpus_lib.split(c, spec.data.val_split, spec.data.val_every, n_files)


def check_tokenizer(spec, workdir: str | None) -> None:
  """What `tokenizer` would refuse, checked before a run writes anything: a given
  tokenizer that does not match model.vocab_size, or a vocabulary too small to train."""
  here = rundir.tokenizer(workdir) if workdir else None
  if spec.data.tokenizer:
    tok_lib.checked(tok_lib.load(spec.data.tokenizer), spec.data.tokenizer,
                    spec.model.vocab_size)
  elif not (here and (epath.Path(here) / tok_lib.PICKLE).exists()):
    tok_lib.check_trainable(spec.model.vocab_size)


def tokenizer(spec, workdir: str | None, train_split=None) -> tok_lib.Tokenizer:
  """The run's tokenizer, kept in WORKDIR/tokenizer/: data.tokenizer when set (copied
  into the run directory), else the run directory's; where there is none, one trained on
  the training split's first data.tokenizer_chars characters, or, with no split given
  (evaluating or sampling a run) or a run directory that already holds checkpoints
  (converted weights), an error naming what is missing."""
  vocab = spec.model.vocab_size
  here = rundir.tokenizer(workdir) if workdir else None
  have = bool(here) and (epath.Path(here) / tok_lib.PICKLE).exists()
  if jax.process_count() > 1:  # process 0's view, before it may write one
    from jax.experimental import multihost_utils
    have = bool(multihost_utils.broadcast_one_to_all(have))
  if spec.data.tokenizer:
    tok = tok_lib.checked(tok_lib.load(spec.data.tokenizer), spec.data.tokenizer, vocab)
    if here and not have and is_main():
      tok.save(here)
    return tok
  if have:
    return tok_lib.checked(tok_lib.load(here), here, vocab)
  if train_split is None or (workdir and rundir.saved_steps(workdir)):
    raise tok_lib.TokenizerError(
        f"--workdir={workdir} has no {rundir.TOKENIZER}/{tok_lib.PICKLE} (the run's tokenizer); "
        "give the one its weights were trained with: --config.data.tokenizer=PATH, or "
        "`python -m bov_jax.convert --tokenizer=DIR` when converting")
  d = spec.data
  if is_main() or not here:
    texts = tok_lib.training_texts(train_split.documents(), d.tokenizer_chars, d.tokenizer_doc_cap)
    tok = tok_lib.train(texts, vocab)
    if here:
      tok.save(here)
  if here and jax.process_count() > 1:  # the others load what process 0 trained
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("bov_jax: tokenizer saved")
    if not is_main():
      tok = tok_lib.load(here)
  return tok
