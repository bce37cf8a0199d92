"""What a run reads: its corpus, split into training and validation documents, and its
tokenizer, found or trained, the same on every process."""

from __future__ import annotations

import jax
from etils import epath
from jax.experimental import multihost_utils

from bov_jax.data import corpus as corpus_lib
from bov_jax.data import tokenizer as tok_lib
from bov_jax.host import process
from bov_jax.store import rundir


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
    have = bool(multihost_utils.broadcast_one_to_all(have))
  if spec.data.tokenizer:
    tok = tok_lib.checked(tok_lib.load(spec.data.tokenizer), spec.data.tokenizer, vocab)
    if here and not have and process.is_main():
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
  if process.is_main() or not here:
    texts = tok_lib.training_texts(train_split.documents(), d.tokenizer_chars, d.tokenizer_doc_cap)
    tok = tok_lib.train(texts, vocab)
    if here:
      tok.save(here)
  if here and jax.process_count() > 1:  # the others load what process 0 trained
    multihost_utils.sync_global_devices("bov_jax: tokenizer saved")
    if not process.is_main():
      tok = tok_lib.load(here)
  return tok
