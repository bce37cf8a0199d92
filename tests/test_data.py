"""Training windows (epoch order, per-process groups, shuffling), packing and exact resume."""
import json

import numpy as np
import pytest

from bov_jax.data import batches as data
from bov_jax.data import corpus
from bov_jax.data import tokenizer as tok_lib


class FakeWindows:
  """Token documents with known contents, `per` to a window, in chunks of two: document i
  is [BOS, i*1000 + 1, i*1000 + 2, ...] (BOS = 0); a finite stream."""

  def __init__(self, lengths, per=3):
    self.lengths, self.per = lengths, per

  def toks(self, i):
    return np.asarray([0] + [i * 1000 + j for j in range(1, self.lengths[i])], np.int32)

  def stream(self, start, offset):
    for k in range(start, -(-len(self.lengths) // self.per)):
      ids = np.arange(k * self.per, min((k + 1) * self.per, len(self.lengths)))
      for o in range(offset if k == start else 0, len(ids), 2):
        yield k, o, ids[o:o + 2], [self.toks(int(i)) for i in ids[o:o + 2]]

  def tokens_of(self, ids):
    return {int(i): self.toks(int(i)) for i in ids}


def _rows(lengths, row_len, buffer_size=4, n=None, per=3):
  it = iter(data.PackedRows(FakeWindows(lengths, per), row_len, buffer_size))
  return [r for _, r in zip(range(n or 10 ** 6), it)]


def test_packer_rows_start_with_bos_no_padding_in_order():
  lengths = np.random.default_rng(0).integers(2, 40, 200).tolist()
  rows = _rows(lengths, 33, buffer_size=8)
  assert len(rows) > 50
  for r in rows:
    assert r.shape == (33,) and r[0] == 0
    # every token comes from one document's prefix, in order
    for piece in np.split(r, np.flatnonzero(r == 0)[1:]):
      assert piece[0] == 0
      if len(piece) > 1:
        d = piece[1] // 1000
        np.testing.assert_array_equal(piece[1:], d * 1000 + np.arange(1, len(piece)))
  used = [p[1] // 1000 for r in rows for p in np.split(r, np.flatnonzero(r == 0)[1:]) if len(p) > 1]
  assert len(used) == len(set(used))  # each document used at most once


def test_packer_best_fit_and_crop():
  # row 1: buffer [6, 3, 5, 9] -> 9 fits (space 10) -> space 1: none fits -> crop shortest (3)
  rows = _rows([6, 3, 5, 9], 10, buffer_size=4, n=2)
  assert list(rows[0][:9]) == [0] + [3000 + j for j in range(1, 9)]
  assert rows[0][9] == 0  # first token (BOS) of the cropped shortest document (doc 1)
  # row 2: buffer [6, 5], space 10 -> 6 (doc 0) -> space 4: crop doc 2 to 4 tokens
  assert list(rows[1]) == [0, 1, 2, 3, 4, 5] + [0, 2001, 2002, 2003]
  assert len(_rows([6, 3, 5, 9], 10, buffer_size=4)) == 2  # then the corpus is spent


def test_packer_resumes_exactly_from_a_json_state():
  lengths = np.random.default_rng(1).integers(2, 60, 300).tolist()
  a = iter(data.PackedRows(FakeWindows(lengths, 7), 50, 16))
  first = [next(a) for _ in range(7)]
  state = json.loads(json.dumps(a.get_state()))  # the state survives JSON (checkpoints)
  rest = [next(a) for _ in range(5)]
  b = iter(data.PackedRows(FakeWindows(lengths, 7), 50, 16))
  b.set_state(state)
  for x, y in zip(rest, [next(b) for _ in range(5)]):
    np.testing.assert_array_equal(x, y)
  c = iter(data.PackedRows(FakeWindows(lengths, 7), 50, 16))
  for x in first:
    np.testing.assert_array_equal(x, next(c))


@pytest.fixture(scope="module")
def tok():
  return tok_lib.train(tok_lib.training_texts(corpus.embedded_documents()[:2000], 500_000), 400)


def _split(n_docs=9000, val_every=10):
  c = corpus.from_documents([f"document {i} " + "word " * (i % 37) for i in range(n_docs)])
  return corpus.split(c, "every_nth", val_every, n_files=0)


def test_windows_shuffle_groups_per_epoch_and_split_them_over_processes(tok):
  train, _ = _split()
  n_groups = len(train.groups)  # 9 groups of 1,024 documents
  ws = [data.TrainWindows(train, tok, seed=3, process_index=p, process_count=2, window_groups=2)
        for p in range(2)]
  per_epoch = ws[0].per_epoch
  assert per_epoch == 3 and ws[1].per_epoch == 2 * 2 // 2  # 5 and 4 groups over windows of 2
  for epoch in range(2):
    seen = [g for w in ws for k in range(epoch * w.per_epoch, (epoch + 1) * w.per_epoch)
            for g in w.groups(k)]
    assert sorted(seen) == list(range(n_groups))  # every group once an epoch, one process each
  e0 = [int(g) for k in range(per_epoch) for g in ws[0].groups(k)]
  e1 = [int(g) for k in range(per_epoch, 2 * per_epoch) for g in ws[0].groups(k)]
  assert e0 != e1  # a new order every epoch
  ids, texts = ws[0].window(0)
  groups = {int(g) for g in ws[0].groups(0)}
  assert {train.corpus.group_of(int(i)) for i in ids} == groups  # only its groups' documents
  assert not np.all(np.diff(ids) > 0)  # shuffled within the window
  assert not np.any(ids % 10 == 0)  # no held-out document
  assert texts == [train.corpus.doc(int(i)) for i in ids]
  again = data.TrainWindows(train, tok, seed=3, process_index=0, process_count=2, window_groups=2)
  np.testing.assert_array_equal(again.window(0)[0], ids)  # deterministic
  # the stream: window 0 from document 300 in chunks of CHUNK_DOCS, tokenized, then window 1
  stream = ws[0].stream(0, offset=300)
  chunks = [next(stream) for _ in range(-(-(len(ids) - 300) // data.CHUNK_DOCS) + 1)]
  assert [c[:2] for c in chunks[:-1]] == [(0, o) for o in range(300, len(ids), data.CHUNK_DOCS)]
  assert chunks[-1][:2] == (1, 0)
  np.testing.assert_array_equal(np.concatenate([c[2] for c in chunks[:-1]]), ids[300:])
  toks = [t for c in chunks[:-1] for t in c[3]]
  assert all(t[0] == tok.bos_id for t in toks)
  assert [tok.decode(t[1:]) for t in toks] == texts[300:]


def test_train_batches_resume_exactly_through_grain_checkpoint_state(tok):
  train, _ = _split()
  make = lambda: data.train_batches(data.TrainWindows(train, tok, seed=0, window_groups=2), 65, 4)
  a = make()
  for _ in range(30):  # across windows
    next(a)
  state = json.loads(json.dumps(a.get_state()))
  want = [next(a) for _ in range(20)]
  b = make()
  b.set_state(state)
  for x, y in zip(want, [next(b) for _ in range(20)]):
    np.testing.assert_array_equal(x, y)
  assert want[0].shape == (4, 65) and want[0].dtype == np.int32


def test_val_rows_are_fixed(tok):
  _, val = _split(3000)
  a = data.val_rows(val.documents(), tok, 33, 5)
  b = data.val_rows(val.documents(), tok, 33, 5)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (5, 33) and np.all(a[:, 0] == tok.bos_id)
  with pytest.raises(data.DataError, match="packs into no full row"):
    data.val_rows(iter(["a"]), tok, 33, 5)


def test_packer_takes_the_oldest_of_equal_fits_and_refills_128_at_a_time():
  """As the reference's loop: the first (oldest) of equally good documents wins, for the
  best fit and for the crop; the buffer is topped up 128 documents at a time."""
  rows = _rows([5, 5, 5, 4, 4], 5, buffer_size=8, n=4, per=5)
  assert [r[1] // 1000 for r in rows[:3]] == [0, 1, 2]  # equal fits: oldest first
  assert list(rows[3]) == [0, 3001, 3002, 3003, 0]  # 4 fits; then crop the oldest shortest
  lengths = [3] * 300
  it = iter(data.PackedRows(FakeWindows(lengths, 10), 30, 200))
  next(it)  # 10 documents of 3 tokens in the row
  assert len(it.get_state()["buffer"]) == 2 * 128 - 10  # 128 < 200: another 128, then 256
