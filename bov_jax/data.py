"""Corpora, the held-out split, BOS-aligned best-fit packing, and batches on grain.

  corpus (documents, random access)        embedded | text/JSONL files | Parquet shards
    -> split: document i is validation iff i % data.val_every == 0 (fixed forever)
    -> this process's part: documents [process_index::process_count]
    -> grain MapDataset: repeat + shuffle (train), tokenize with BOS
    -> PackedRows: rows of T+1 tokens, best-fit with cropping
    -> grain batch: [device_batch_size * local devices, T+1]

The packer is the one transform written by hand: grain packs by padding or by
splitting documents across rows, not by cropping the shortest document to fill
a row. Its state (next document, documents in the buffer) is small and exact,
so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import bisect
import functools
import glob
import json
import os
import re
import sysconfig

import grain
import numpy as np


class DataError(ValueError):
  """A corpus setting points at nothing usable."""


# -- corpora -------------------------------------------------------------------

def _split_source(text: str, max_chars: int = 1500) -> list[str]:
  """Cuts a long source file into documents at blank lines, merged up to
  max_chars, so that packing crops little of the embedded corpus."""
  blocks = re.split(r"\n\s*\n", text)
  docs, cur = [], ""
  for b in blocks:
    if cur and len(cur) + len(b) + 2 > max_chars:
      docs.append(cur)
      cur = b
    else:
      cur = f"{cur}\n\n{b}" if cur else b
  if cur.strip():
    docs.append(cur)
  return [d for d in docs if d.strip()]


@functools.lru_cache(maxsize=1)
def embedded_documents() -> tuple[str, ...]:
  """Text every Python install has: the standard library's source and pydoc topics."""
  root = sysconfig.get_paths()["stdlib"]
  skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
  files = []
  for d, dirs, names in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in skip)
    files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
  docs = []
  for path in files:
    try:
      with open(path, encoding="utf-8") as f:
        docs += _split_source(f.read())
    except (UnicodeDecodeError, OSError):
      continue
  try:
    from pydoc_data import topics
    for key in sorted(topics.topics):
      docs += _split_source(topics.topics[key])
  except ImportError:
    pass
  return tuple(docs)


class ParquetDocuments:
  """Rows of a `text` column across Parquet shards, random access by global row."""

  def __init__(self, files: list[str], column: str = "text"):
    import pyarrow.parquet as pq
    self.files, self.column = files, column
    self._groups = []  # (file, row group, first global row)
    start = 0
    for f in files:
      meta = pq.ParquetFile(f).metadata
      names = pq.ParquetFile(f).schema_arrow.names
      if column not in names:
        raise DataError(f"data.corpus: {f} has no '{column}' column (columns: {names})")
      for g in range(meta.num_row_groups):
        self._groups.append((f, g, start))
        start += meta.row_group(g).num_rows
    self._n = start
    self._starts = [s for _, _, s in self._groups]
    self._cache = (None, None)

  def __len__(self):
    return self._n

  def __getitem__(self, i: int) -> str:
    import pyarrow.parquet as pq
    k = bisect.bisect_right(self._starts, i) - 1
    f, g, start = self._groups[k]
    if self._cache[0] != (f, g):
      col = pq.ParquetFile(f).read_row_group(g, columns=[self.column]).column(0)
      self._cache = ((f, g), col.to_pylist())
    return self._cache[1][i - start]


def _read_text_file(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    if path.endswith((".jsonl", ".json")):
      docs = []
      for n, line in enumerate(f, 1):
        if line.strip():
          try:
            docs.append(json.loads(line)["text"])
          except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"data.corpus: {path} line {n} is not a JSON object with a "
                            f"'text' field ({e})") from e
      return docs
    return [f.read()]


def documents(corpus: str):
  """A random-access sequence of document strings for `data.corpus`."""
  if corpus == "embedded":
    return embedded_documents()
  if os.path.isdir(corpus):
    files = sorted(p for p in glob.glob(os.path.join(corpus, "**", "*"), recursive=True)
                   if os.path.isfile(p))
  else:
    files = sorted(glob.glob(corpus))
    if not files:
      raise DataError(f"data.corpus={corpus!r}: no such file, directory or glob match "
                      "(expected 'embedded', a .txt/.jsonl/.parquet file, a directory or a glob)")
  parquet = [f for f in files if f.endswith(".parquet")]
  texts = [f for f in files if f.endswith((".txt", ".jsonl", ".json", ".md"))]
  if parquet and texts:
    raise DataError(f"data.corpus={corpus!r} mixes Parquet and text files; use one kind")
  if parquet:
    docs = ParquetDocuments(parquet)
  else:
    docs = [d for f in texts for d in _read_text_file(f)]
  if len(docs) == 0:
    raise DataError(f"data.corpus={corpus!r} holds no documents (expected .txt, .jsonl with "
                    "a 'text' field, or .parquet with a 'text' column, and some text in them)")
  return docs


class Subset:
  """Documents at the given indices of a parent sequence (lazy)."""

  def __init__(self, parent, indices):
    self.parent, self.indices = parent, indices

  def __len__(self):
    return len(self.indices)

  def __getitem__(self, i):
    return self.parent[int(self.indices[i])]


def split(docs, val_every: int, which: str) -> Subset:
  """The fixed held-out split: document i is validation iff i % val_every == 0."""
  n = len(docs)
  idx = np.arange(n)
  if n < 2:
    raise DataError("the corpus needs at least 2 documents (one is held out for validation)")
  chosen = idx[idx % val_every == 0] if which == "val" else idx[idx % val_every != 0]
  return Subset(docs, chosen)


def shard(docs, process_index: int, process_count: int) -> Subset:
  """This process's documents: disjoint across processes, together all of them."""
  idx = np.arange(process_index, len(docs), process_count)
  if len(idx) == 0:
    raise DataError(f"process {process_index} of {process_count} gets no documents; "
                    "the corpus is too small for this many hosts")
  return Subset(docs, idx)


# -- packing -------------------------------------------------------------------

class PackedRows(grain.IterDataset):
  """Rows of `row_len` tokens, BOS-aligned best fit with cropping.

  Reads tokenized documents in order from a MapDataset (indices 0, 1, 2, ...).
  Each row: take the largest buffered document that fits the space left; when
  none fits, take the shortest, put its first tokens in the space left, drop
  the rest. Rows start with BOS (every document does) and carry no padding.
  """

  def __init__(self, docs: grain.MapDataset, row_len: int, buffer_size: int = 1000):
    super().__init__()
    self.docs, self.row_len, self.buffer_size = docs, row_len, buffer_size

  def __iter__(self):
    return _PackedRowsIterator(self.docs, self.row_len, self.buffer_size)


class _PackedRowsIterator(grain.DatasetIterator):

  def __init__(self, docs, row_len, buffer_size):
    super().__init__()
    self.docs, self.row_len, self.buffer_size = docs, row_len, buffer_size
    self._n = len(docs)
    self._next = 0
    self._buffer = []  # sorted by (length, doc index): (len, index, tokens)

  def _fill(self):
    while len(self._buffer) < self.buffer_size and self._next < self._n:
      toks = np.asarray(self.docs[self._next], np.int32)
      bisect.insort(self._buffer, (len(toks), self._next, toks), key=lambda e: e[:2])
      self._next += 1

  def __next__(self):
    row = []
    space = self.row_len
    while space > 0:
      self._fill()
      if not self._buffer:  # the documents ran out: an unfinished row is dropped, not padded
        raise StopIteration
      k = bisect.bisect_right(self._buffer, (space, float("inf")), key=lambda e: e[:2]) - 1
      if k >= 0:  # the largest document that fits
        _, _, toks = self._buffer.pop(k)
        row.append(toks)
        space -= len(toks)
      else:  # none fits: crop the shortest
        _, _, toks = self._buffer.pop(0)
        row.append(toks[:space])
        space = 0
    return np.concatenate(row)

  def get_state(self):
    return {"next": int(self._next), "buffer": [int(i) for _, i, _ in self._buffer]}

  def set_state(self, state):
    self._next = int(state["next"])
    self._buffer = []
    for i in state["buffer"]:
      toks = np.asarray(self.docs[i], np.int32)
      self._buffer.append((len(toks), i, toks))
    self._buffer.sort(key=lambda e: e[:2])


# -- pipelines -------------------------------------------------------------------

def _tokenized(docs, tok, shuffle_seed=None):
  ds = grain.MapDataset.source(docs)
  if shuffle_seed is not None:
    ds = ds.repeat().shuffle(seed=shuffle_seed)  # a new order every epoch
  return ds.map(tok.encode)


def train_batches(docs, tok, row_len: int, rows: int, seed: int, buffer_size: int = 1000):
  """An endless, checkpointable iterator of [rows, row_len] int32 batches."""
  packed = PackedRows(_tokenized(docs, tok, shuffle_seed=seed), row_len, buffer_size)
  return iter(packed.batch(rows, drop_remainder=True))


def val_rows(docs, tok, row_len: int, n_rows: int, buffer_size: int = 1000) -> np.ndarray:
  """The first n_rows packed rows of the held-out documents: the same tokens every time."""
  it = iter(PackedRows(_tokenized(docs, tok), row_len, buffer_size))
  rows = []
  for row in it:
    rows.append(row)
    if len(rows) == n_rows:
      break
  if not rows:
    raise DataError("the validation split packs into no full row; use a larger corpus "
                    "or a shorter model.sequence_len")
  return np.stack(rows)
