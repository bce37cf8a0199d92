"""Corpora, tokenizer, packing, splits and shards."""
import json

import numpy as np
import pytest

from bov_jax import data
from bov_jax import tokenizer as tok_lib


@pytest.fixture(scope="module")
def tok():
  docs = data.embedded_documents()
  return tok_lib.train((docs[i] for i in range(0, len(docs), 4)), 512)


def test_embedded_corpus_needs_no_download():
  docs = data.embedded_documents()
  assert len(docs) > 1000 and sum(map(len, docs)) > 1_000_000
  assert any("def " in d for d in docs[:50])


def test_tokenizer_specials_at_top_and_round_trip(tok):
  assert tok.vocab_size == 512
  assert tok.bos_id == 512 - 9
  assert tok.tok.token_to_id("<|output_end|>") == 511
  text = "def f(x):\n    return x ** 2  # ünïcode 12345\n"
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == text
  assert all(len(t) <= 2 for t in tok.tok.encode("1234567", add_special_tokens=False).tokens)


def test_token_bytes(tok):
  tb = tok.token_bytes()
  assert tb.shape == (512,) and np.all(tb[-9:] == 0)
  for i in (0, 100, 300, 500):
    assert tb[i] == len(tok.tok.decode([i]).encode("utf-8"))
  ids = tok.encode("hello world", bos=False)
  assert tb[ids].sum() == len("hello world")


def test_tokenizer_saved_and_reused(tmp_path):
  docs = data.embedded_documents()
  texts = lambda: iter(docs[:200])
  a = tok_lib.load_or_train(str(tmp_path), texts, 300)
  assert (tmp_path / "tokenizer.json").exists()
  b = tok_lib.load_or_train(str(tmp_path), lambda: iter(["zzz"]), 300)  # not retrained
  assert a.encode("abc def ghi") == b.encode("abc def ghi")
  with pytest.raises(ValueError, match="model.vocab_size=400"):
    tok_lib.load_or_train(str(tmp_path), texts, 400)


class _Docs:
  """Token documents with known contents: doc i = [BOS, i*1000 + 1, i*1000 + 2, ...]."""

  def __init__(self, lengths, bos=0):
    self.lengths, self.bos = lengths, bos

  def __len__(self):
    return len(self.lengths)

  def __getitem__(self, i):
    return [self.bos] + [i * 1000 + j for j in range(1, self.lengths[i])]


def _rows(lengths, row_len, buffer_size=4, n=None):
  import grain
  ds = grain.MapDataset.source(_Docs(lengths))
  it = iter(data.PackedRows(ds, row_len, buffer_size))
  return [r for _, r in zip(range(n or 10 ** 6), it)]


def test_packer_rows_start_with_bos_no_padding_in_order():
  rng = np.random.default_rng(0)
  lengths = rng.integers(2, 40, 200).tolist()
  rows = _rows(lengths, 33, buffer_size=8)
  assert len(rows) > 50
  for r in rows:
    assert r.shape == (33,) and r[0] == 0
    # every token comes from one document's prefix, in order: the pieces of a row are
    # runs BOS, d*1000+1, d*1000+2, ...
    pieces = np.split(r, np.flatnonzero(r == 0)[1:])
    for piece in pieces:
      assert piece[0] == 0
      if len(piece) > 1:
        d = piece[1] // 1000
        np.testing.assert_array_equal(piece[1:], d * 1000 + np.arange(1, len(piece)))
  used = [p[1] // 1000 for r in rows for p in np.split(r, np.flatnonzero(r == 0)[1:]) if len(p) > 1]
  assert len(used) == len(set(used))  # each document used at most once


def test_packer_best_fit_and_crop():
  # row 10: buffer [6, 3, 5, 9] -> 9 fits (space 10) -> space 1: none fits -> crop shortest (3)
  rows = _rows([6, 3, 5, 9], 10, buffer_size=4, n=2)
  assert list(rows[0][:9]) == [0] + [3000 + j for j in range(1, 9)]
  assert rows[0][9] == 0  # first token (BOS) of the cropped shortest document (doc 1)
  # row 2: buffer [6, 5], space 10 -> 6 (doc 0) -> space 4: crop doc 2 to 4 tokens
  assert list(rows[1]) == [0, 1, 2, 3, 4, 5] + [0, 2001, 2002, 2003]
  assert len(_rows([6, 3, 5, 9], 10, buffer_size=4)) == 2  # then the corpus is spent


def test_packer_is_deterministic_and_resumes_exactly():
  import grain
  lengths = np.random.default_rng(1).integers(2, 60, 300).tolist()
  ds = grain.MapDataset.source(_Docs(lengths))
  a = iter(data.PackedRows(ds, 50, 16))
  first = [next(a) for _ in range(7)]
  state = a.get_state()
  rest = [next(a) for _ in range(5)]
  b = iter(data.PackedRows(ds, 50, 16))
  b.set_state(json.loads(json.dumps(state)))  # the state survives JSON (checkpoints)
  for x, y in zip(rest, [next(b) for _ in range(5)]):
    np.testing.assert_array_equal(x, y)
  c = iter(data.PackedRows(ds, 50, 16))
  for x in first:
    np.testing.assert_array_equal(x, next(c))


def test_split_is_fixed_and_shards_are_disjoint():
  docs = [f"doc {i}" for i in range(103)]
  val = data.split(docs, 10, "val")
  train = data.split(docs, 10, "train")
  assert [val[i] for i in range(len(val))] == [f"doc {i}" for i in range(0, 103, 10)]
  assert len(val) + len(train) == 103
  shards = [data.shard(train, p, 4) for p in range(4)]
  seen = [s[i] for s in shards for i in range(len(s))]
  assert len(seen) == len(set(seen)) == len(train)


def test_corpus_files(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "first"}\n\n{"text": "second"}\n')
  (tmp_path / "b.txt").write_text("third document")
  docs = data.documents(str(tmp_path))
  assert sorted(docs) == ["first", "second", "third document"]
  import pyarrow as pa
  import pyarrow.parquet as pq
  pdir = tmp_path / "pq"
  pdir.mkdir()
  for k in range(2):
    pq.write_table(pa.table({"text": [f"s{k} r{i}" for i in range(5)]}),
                   pdir / f"shard_{k:05d}.parquet", row_group_size=2)
  pdocs = data.documents(str(pdir / "*.parquet"))
  assert len(pdocs) == 10 and pdocs[0] == "s0 r0" and pdocs[7] == "s1 r2" and pdocs[9] == "s1 r4"


def test_corpus_errors(tmp_path):
  with pytest.raises(data.DataError, match=r"data\.corpus='/nonexistent/x\.txt': no such file"):
    data.documents("/nonexistent/x.txt")
  (tmp_path / "empty").mkdir()
  with pytest.raises(data.DataError, match="holds no documents"):
    data.documents(str(tmp_path / "empty"))
  (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
  with pytest.raises(data.DataError, match=r"bad\.jsonl line 1"):
    data.documents(str(tmp_path / "bad.jsonl"))
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"content": ["x"]}), tmp_path / "c.parquet")
  with pytest.raises(data.DataError, match="no 'text' column"):
    data.documents(str(tmp_path / "c.parquet"))
