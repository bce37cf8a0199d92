"""Training batches and validation rows from a corpus split (corpus.py).

  train split's groups (Parquet row groups, or blocks of a text corpus)
    -> each epoch: the groups in a new order (seed, epoch); this process takes every
       process_count-th, so it reads only its own documents
    -> windows of WINDOW_GROUPS groups: read, documents shuffled within the window
       (seed, epoch, window), read ahead in a background thread (grain)
    -> chunks of CHUNK_DOCS documents tokenized with BOS on every core, CHUNKS_AHEAD of
       them ahead on the tokenizer's threads, so packing never waits on reading or
       tokenizing, and a run tokenizes only what it is about to pack
    -> PackedRows: rows of T+1 tokens, BOS-aligned best fit with cropping
    -> grain batch: [device_batch_size * local devices, T+1]

The packer is the one transform written by hand: grain packs by padding or by splitting
documents across rows, not by cropping the shortest document to fill a row. Its state
(the window it reads, how far, and the documents in its buffer by id) is small and
exact, so a resumed run sees exactly the batches an uninterrupted run would, on every
host.
"""

from __future__ import annotations

import bisect
import collections
import math

import grain
import numpy as np

from bov_jax.data.corpus import DataError

WINDOW_GROUPS = 4  # documents are shuffled within windows of this many groups (~4k docs)
REFILL = 128  # the reference tops its buffer up a tokenizer batch (128 documents) at a time
CHUNK_DOCS = 256  # documents tokenized at a time (benchmarks.data: smaller chunks cost throughput)
CHUNKS_AHEAD = 4  # chunks tokenized ahead of the packer: two of its 1,000-document buffers


class TrainWindows:
  """This process's stream of tokenized windows: window k is the k-th of all epochs."""

  def __init__(self, split, tok, seed: int, process_index: int = 0, process_count: int = 1,
               window_groups: int = WINDOW_GROUPS):
    self.split, self.tok, self.seed = split, tok, seed
    self.pi, self.pc, self.window_groups = process_index, process_count, window_groups
    n = len(split.groups)
    self.my_groups = len(range(process_index, n, process_count))
    if self.my_groups == 0:
      raise DataError(f"process {process_index} of {process_count} gets no training documents: "
                      f"the split has {n} groups (Parquet row groups); use a larger corpus")
    self.per_epoch = math.ceil(self.my_groups / window_groups)

  def groups(self, k: int) -> np.ndarray:
    epoch, w = divmod(k, self.per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(len(self.split.groups))
    mine = self.split.groups[order][self.pi::self.pc]
    return mine[w * self.window_groups:(w + 1) * self.window_groups]

  def window(self, k: int):
    """(document ids, texts) of window k, in its shuffled order."""
    ids, texts = [], []
    for g in self.groups(k):
      i, t = self.split.group_docs(int(g))
      ids.append(i)
      texts += t
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    order = np.random.default_rng([self.seed, k, 1]).permutation(len(texts))
    return ids[order], [texts[i] for i in order]

  def tokens_of(self, ids) -> dict:
    """{id: tokens} for documents by id (a resume rebuilds the packer's buffer)."""
    corpus = self.split.corpus
    by_group = {}
    for i in ids:
      by_group.setdefault(corpus.group_of(int(i)), []).append(int(i))
    out = {}
    for g, members in by_group.items():
      texts = corpus.read(g)
      start = int(corpus.starts[g])
      out.update(zip(members, self.tok.encode_batch([texts[i - start] for i in members])))
    return out

  def stream(self, start: int, offset: int = 0):
    """Tokenized chunks (window k, its first document's position in the window, ids,
    token arrays) of windows start, start+1, ..., from document `offset` of the first."""
    windows = grain.MapDataset.range(start, 2 ** 62).map(lambda k: (k, *self.window(k)))
    windows = windows.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
    started = collections.deque()
    for k, ids, texts in windows:
      for o in range(offset if k == start else 0, len(ids), CHUNK_DOCS):
        # CHUNKS_AHEAD chunks on the tokenizer's threads at once: the cores never wait on a
        # chunk's last document (grain's prefetch would tokenize one chunk at a time)
        started.append((k, o, ids[o:o + CHUNK_DOCS],
                        self.tok.encode_batch_started(texts[o:o + CHUNK_DOCS])))
        if len(started) > CHUNKS_AHEAD:
          k0, o0, ids0, toks = started.popleft()
          yield k0, o0, ids0, list(toks)


class PackedRows(grain.IterDataset):
  """Rows of `row_len` tokens, BOS-aligned best fit with cropping, as the reference's
  dataloader packs them. Before each choice the buffer is topped up, REFILL documents at
  a time, while it holds fewer than `buffer_size`. Each row: take the largest buffered
  document that fits the space left (the oldest among equally long ones); when none fits,
  take the shortest (the oldest among equals), put its first tokens in the space left,
  drop the rest. Rows start with BOS (every document does) and carry no padding."""

  def __init__(self, windows: TrainWindows, row_len: int, buffer_size: int = 1000):
    super().__init__()
    self.windows, self.row_len, self.buffer_size = windows, row_len, buffer_size

  def __iter__(self):
    return _PackedRowsIterator(self.windows, self.row_len, self.buffer_size)


class _PackedRowsIterator(grain.DatasetIterator):

  def __init__(self, windows, row_len, buffer_size):
    super().__init__()
    self.windows, self.row_len, self.buffer_size = windows, row_len, buffer_size
    self._k, self._offset = 0, 0      # the window being read, and the next document in it
    self._stream = self._chunk = None  # started at the first document asked for
    self._done = False                # a finite source (validation) has run out
    self._seq = 0                     # documents taken so far: their age in the buffer
    self._buffer = []  # sorted by (length, age): (length, age, document id, tokens)
    self._by_age = {}  # age -> document id of the buffered documents, oldest first

  def _next_doc(self):
    if self._stream is None:
      self._stream, self._chunk = self.windows.stream(self._k, self._offset), None
    while True:
      if self._chunk is not None:
        k, first, ids, toks = self._chunk
        i = self._offset - first
        if i < len(ids):
          self._offset += 1
          return int(ids[i]), toks[i]
      self._chunk = next(self._stream)
      if self._chunk[0] != self._k:  # window k ran out: the next one with documents
        self._k, self._offset = self._chunk[0], 0

  def _add(self, i, toks):
    bisect.insort(self._buffer, (len(toks), self._seq, i, toks), key=lambda e: e[:2])
    self._by_age[self._seq] = i
    self._seq += 1

  def _take(self, k):
    entry = self._buffer.pop(k)
    del self._by_age[entry[1]]
    return entry[3]

  def _fill(self):
    while not self._done and len(self._buffer) < self.buffer_size:
      for _ in range(REFILL):
        try:
          self._add(*self._next_doc())
        except StopIteration:
          self._done = True
          return

  def __next__(self):
    row = []
    space = self.row_len
    while space > 0:
      self._fill()
      if not self._buffer:  # the documents ran out: an unfinished row is dropped, not padded
        raise StopIteration
      k = bisect.bisect_right(self._buffer, (space, float("inf")), key=lambda e: e[:2]) - 1
      if k >= 0:  # the largest document that fits: the oldest of that length
        k = bisect.bisect_left(self._buffer, (self._buffer[k][0], -1), key=lambda e: e[:2])
        toks = self._take(k)
        row.append(toks)
        space -= len(toks)
      else:  # none fits: crop the shortest (the oldest of that length)
        row.append(self._take(0)[:space])
        space = 0
    return np.concatenate(row)

  def get_state(self):
    """The window being read, how far, and the buffered documents' ids from oldest."""
    return {"window": int(self._k), "offset": int(self._offset),
            "buffer": [int(i) for i in self._by_age.values()]}  # read before each batch

  def set_state(self, state):
    self._k, self._offset = int(state["window"]), int(state["offset"])
    self._stream = None  # restarts at that window when next read
    toks = self.windows.tokens_of(state["buffer"])
    self._buffer, self._by_age, self._seq = [], {}, 0
    for i in state["buffer"]:
      self._add(i, toks[i])


def train_batches(windows: TrainWindows, row_len: int, rows: int, buffer_size: int = 1000):
  """An endless, checkpointable iterator of [rows, row_len] int32 batches."""
  return iter(PackedRows(windows, row_len, buffer_size).batch(rows, drop_remainder=True))


def val_rows(docs, tok, row_len: int, n_rows: int, buffer_size: int = 1000) -> np.ndarray:
  """The first n_rows packed rows of the held-out documents (an iterable, in order), packed
  like training rows: the same tokens every time."""
  class _InOrder:  # the packer's window source over a fixed sequence of documents
    def __init__(self):
      self.docs = iter(docs)

    def stream(self, start, offset):  # one window (0), in order
      while True:
        chunk = [d for _, d in zip(range(CHUNK_DOCS), self.docs)]
        if not chunk:
          return
        yield 0, offset, np.arange(offset, offset + len(chunk)), tok.encode_batch(chunk)
        offset += len(chunk)

  it = _PackedRowsIterator(_InOrder(), row_len, buffer_size)
  rows = []
  for row in it:
    rows.append(row)
    if len(rows) == n_rows:
      break
  if not rows:
    raise DataError("the validation split packs into no full row; use a larger corpus "
                    "or a shorter model.sequence_len")
  return np.stack(rows)
