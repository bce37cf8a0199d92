"""The input pipeline's speed against the tokenizer's.

  python -m benchmarks.data --config=FILE [--config.data.corpus=...] [--json]
      [--synthetic_shards=20] [--seconds=20] [--tokenizer_chars=20000000]

Times the tokenizer alone on the documents of the pipeline's first windows
(`encode_batch` on every core): `tokenizer_tokens_per_s`. Then runs this host's training
pipeline (data.TrainWindows -> data.train_batches: Parquet row groups read and shuffled
in windows, tokenized in background threads, packed, batched) for --seconds after its
first batch: `tokens_per_s`, packed training tokens delivered per second, all cores.
Packing crops documents (as the reference does), so the tokens it delivers are fewer
than the tokens it tokenizes. With
--synthetic_shards=N the corpus is N shards of ClimbMix-like Parquet written to a
temporary directory: documents of 100 to 20,000 characters (log-uniform) cut from the
embedded corpus, 1,024 documents per row group. The tokenizer is data.tokenizer, or one
trained on --tokenizer_chars characters of the corpus.
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np
from absl import app
from absl import flags
from absl import logging

from benchmarks import common
from bov_jax import cli
from bov_jax.data import batches as data
from bov_jax.data import corpus as corpus_lib
from bov_jax.data import sources
from bov_jax.data import tokenizer as tok_lib

_SHARDS = flags.DEFINE_integer("synthetic_shards", 0, "write this many ClimbMix-like shards "
                               "to a temporary directory and read them (0: data.corpus)")
_GROUPS = flags.DEFINE_integer("groups_per_shard", 2, "row groups per synthetic shard")
_SECONDS = flags.DEFINE_float("seconds", 20.0, "how long the pipeline runs")
_TOK_CHARS = flags.DEFINE_integer("tokenizer_chars", 20_000_000,
                                  "characters to train a tokenizer on (without data.tokenizer)")


def write_synthetic(directory: str, shards: int, groups_per_shard: int, seed: int = 0) -> str:
  """ClimbMix-like shards: shard_00000.parquet ..., a `text` column, 1,024 documents a row
  group, documents of 100-20,000 characters cut from the embedded corpus."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  text = "\n\n".join(corpus_lib.embedded_documents())
  rng = np.random.default_rng(seed)
  group = corpus_lib.GROUP_DOCS
  for k in range(shards):
    n = group * groups_per_shard
    lengths = np.exp(rng.uniform(np.log(100), np.log(20_000), n)).astype(int)
    starts = rng.integers(0, len(text) - 20_000, n)
    docs = [text[s:s + m] for s, m in zip(starts, lengths)]
    pq.write_table(pa.table({"text": docs}), os.path.join(directory, f"shard_{k:05d}.parquet"),
                   row_group_size=group)
  return directory


def bench_data(spec, seconds: float, tokenizer_chars: int) -> dict:
  train, _ = sources.documents(spec)
  if spec.data.tokenizer:
    tok = tok_lib.load(spec.data.tokenizer)
  else:
    tok = tok_lib.train(tok_lib.training_texts(train.documents(), tokenizer_chars),
                        spec.model.vocab_size)
  T = spec.model.sequence_len
  rows = spec.batch.local_rows
  windows = data.TrainWindows(train, tok, spec.train.seed, jax.process_index(),
                              jax.process_count())
  # the tokenizer alone, on every core, on the documents of the pipeline's first windows
  # (before the pipeline's threads start)
  texts = [t for k in range(2) for g in windows.groups(k) for t in train.group_docs(int(g))[1]]
  t0 = time.perf_counter()
  tokens = sum(len(ids) for ids in tok.encode_batch(texts))
  raw = tokens / (time.perf_counter() - t0)
  it = data.train_batches(windows, T + 1, rows)
  next(it)  # the first chunks: read and tokenized before anything comes out
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    n += next(it).shape[0] * T
  pipeline = n / (time.perf_counter() - t0)
  return {"bench": "data", "corpus": spec.data.corpus, "cores": os.cpu_count(),
          "rows": rows, "row_tokens": T, "tokens_per_s": pipeline,
          "tokenizer_tokens_per_s": raw, "pipeline_over_tokenizer": pipeline / raw,
          "window_groups": data.WINDOW_GROUPS}


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = common.CONFIG.value
  if cfg is None:
    raise app.UsageError("--config=FILE is required")
  with tempfile.TemporaryDirectory(prefix="bov_jax_synthetic_") as tmp:
    if _SHARDS.value:
      cfg.data.corpus = write_synthetic(tmp, _SHARDS.value, _GROUPS.value)
    common.emit(bench_data(common.spec_from_flags(), _SECONDS.value, _TOK_CHARS.value))


if __name__ == "__main__":
  cli.run(main)  # a missing extra: one line, exit 1
