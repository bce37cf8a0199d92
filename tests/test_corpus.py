"""Corpora (text, JSONL, Parquet; local or bucket), the held-out split, fetching ClimbMix."""
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bov_jax.data import corpus
from tests.helpers import command
from tests.helpers import corrupt_row_group


def write_shards(d, n_files, rows, group=2, prefix="s"):
  d.mkdir(parents=True, exist_ok=True)
  for k in range(n_files):
    pq.write_table(pa.table({"text": [f"{prefix}{k} r{i}" for i in range(rows)]}),
                   d / f"shard_{k:05d}.parquet", row_group_size=group)


def test_embedded_corpus_needs_no_download():
  docs = corpus.embedded_documents()
  assert len(docs) > 1000 and sum(map(len, docs)) > 1_000_000
  assert any("def " in d for d in docs[:50])
  c = corpus.open_corpus("embedded")
  assert c.n_docs == len(docs) and c.doc(1500) == docs[1500]


def test_text_jsonl_and_parquet_corpora(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "first"}\n\n{"text": "second"}\n')
  (tmp_path / "b.txt").write_text("third document")
  assert sorted(corpus.open_corpus(str(tmp_path)).documents()) == ["first", "second",
                                                                   "third document"]
  write_shards(tmp_path / "pq", 2, 5)
  c = corpus.open_corpus(str(tmp_path / "pq" / "*.parquet"))
  assert c.n_docs == 10 and c.n_groups == 6  # 3 row groups of <= 2 rows per file
  assert c.doc(0) == "s0 r0" and c.doc(7) == "s1 r2" and c.doc(9) == "s1 r4"
  assert list(c.files) == [0, 0, 0, 1, 1, 1] and c.read(4) == ["s1 r2", "s1 r3"]


def test_corpus_errors_are_named(tmp_path):
  with pytest.raises(corpus.DataError, match=r"data\.corpus='/nonexistent/x\.txt': no such file"
                     r".*python -m bov_jax\.corpus download"):
    corpus.open_corpus("/nonexistent/x.txt")
  (tmp_path / "empty").mkdir()
  with pytest.raises(corpus.DataError, match="no such file"):
    corpus.open_corpus(str(tmp_path / "empty"))
  (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
  with pytest.raises(corpus.DataError, match=r"bad\.jsonl line 1"):
    corpus.open_corpus(str(tmp_path / "bad.jsonl"))
  pq.write_table(pa.table({"content": ["x"]}), tmp_path / "c.parquet")
  with pytest.raises(corpus.DataError, match="no 'text' column"):
    corpus.open_corpus(str(tmp_path / "c.parquet"))


def test_bad_files_are_named_by_file_and_place(tmp_path):
  d = tmp_path / "pq"
  rng = np.random.default_rng(0)
  texts = ["".join(rng.choice(list("abcdefgh "), 300)) for _ in range(40)]
  pq.write_table(pa.table({"text": texts}),
                 tmp_path / "whole.parquet", row_group_size=10, compression="snappy")
  d.mkdir()
  raw = (tmp_path / "whole.parquet").read_bytes()
  (d / "shard_00000.parquet").write_bytes(raw)
  (d / "shard_00001.parquet").write_bytes(raw[:len(raw) // 2])  # a truncated copy
  with pytest.raises(corpus.DataError, match=r"data\.corpus: .*shard_00001\.parquet is not a "
                     "readable Parquet file .*footer"):
    corpus.open_corpus(str(d))
  (d / "shard_00001.parquet").write_bytes(b"")
  with pytest.raises(corpus.DataError, match=r"shard_00001\.parquet is not a readable Parquet "
                     "file .*0 bytes"):
    corpus.open_corpus(str(d))
  (d / "shard_00001.parquet").unlink()
  corrupt_row_group(d / "shard_00000.parquet", 2)
  c = corpus.open_corpus(str(d))  # the footer reads: the damage shows when group 2 is read
  assert len(c.read(1)) == 10
  with pytest.raises(corpus.DataError, match=r"data\.corpus: .*shard_00000\.parquet row group 2 "
                     "cannot be read"):
    c.read(2)
  utf8 = pa.array([b"fine", b"bad \xff\xfe"], pa.binary()).cast(pa.string(), safe=False)
  pq.write_table(pa.table({"text": utf8}), tmp_path / "u.parquet")
  with pytest.raises(corpus.DataError, match=r"u\.parquet row group 0 cannot be read "
                     r"\(UnicodeDecodeError"):
    corpus.open_corpus(str(tmp_path / "u.parquet")).read(0)
  pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
  with pytest.raises(corpus.DataError, match=r"n\.parquet row group 0 row 1: 'text' is None"):
    corpus.open_corpus(str(tmp_path / "n.parquet")).read(0)
  (tmp_path / "t.txt").write_bytes(b"one\ntwo\n\xff three\n")
  with pytest.raises(corpus.DataError, match=r"data\.corpus: .*t\.txt line 3 is not UTF-8"):
    corpus.open_corpus(str(tmp_path / "t.txt"))
  (tmp_path / "j.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
  with pytest.raises(corpus.DataError, match=r"j\.jsonl line 2 is not a JSON object"):
    corpus.open_corpus(str(tmp_path / "j.jsonl"))
  (tmp_path / "k.jsonl").write_text('{"text": 3}\n')
  with pytest.raises(corpus.DataError, match=r"k\.jsonl line 1: 'text' is a int"):
    corpus.open_corpus(str(tmp_path / "k.jsonl"))


def test_one_text_file_is_a_corpus_of_its_paragraphs(tmp_path):
  paragraphs = [f"Paragraph {i}.\n" + "some words " * 30 for i in range(40)]
  (tmp_path / "book.txt").write_text("\n\n".join(paragraphs))
  c = corpus.open_corpus(str(tmp_path / "book.txt"))
  docs = list(c.documents())
  assert 5 < len(docs) < 40 and all(len(d) <= 1500 for d in docs)  # merged up to 1,500 chars
  assert "\n\n".join(docs) == "\n\n".join(paragraphs)  # nothing lost or reordered
  train, val = corpus.split(c, "auto", 4, n_files=0)
  assert len(list(val.documents())) > 0 and len(list(train.documents())) > 0


def test_every_nth_split_is_fixed_and_process_shares_are_disjoint():
  c = corpus.from_documents([f"doc {i}" for i in range(2103)])
  train, val = corpus.split(c, "auto", 10, n_files=0)
  assert list(val.documents()) == [f"doc {i}" for i in range(0, 2103, 10)]
  shares = [list(train.documents(p, 4)) for p in range(4)]
  seen = [d for s in shares for d in s]
  assert len(seen) == len(set(seen)) == 2103 - 211
  assert not set(seen) & set(val.documents())


def test_last_shard_is_the_validation_split(tmp_path):
  write_shards(tmp_path, 3, 4)
  c = corpus.open_corpus(str(tmp_path))
  train, val = corpus.split(c, "auto", 20, n_files=3)  # auto: two or more Parquet files
  assert list(val.documents()) == [f"s2 r{i}" for i in range(4)]
  assert sorted(d for g in train.groups for d in train.group_docs(int(g))[1]) == sorted(
      f"s{k} r{i}" for k in range(2) for i in range(4))
  with pytest.raises(corpus.DataError, match=r"data\.val_split='last_shard' needs two or more"):
    corpus.split(corpus.from_documents(["a", "b"]), "last_shard", 20, n_files=1)


def test_download_fetches_what_is_missing_and_the_validation_shard(tmp_path):
  assert corpus.climbmix_shards(3) == ["shard_00000.parquet", "shard_00001.parquet",
                                       "shard_00002.parquet", "shard_06542.parquet"]
  (tmp_path / "shard_00001.parquet").write_bytes(b"done")  # complete from an earlier run
  assert corpus.download(3, str(tmp_path), dry_run=True) == [
      "shard_00000.parquet", "shard_00002.parquet", "shard_06542.parquet"]
  fetched = []

  def fetch(name):
    if name == "shard_00002.parquet" and not fetched.count(name):
      fetched.append(name)
      raise ConnectionError("cut short")  # a download that fails leaves no final file
    fetched.append(name)
    (tmp_path / name).write_bytes(b"data")

  with pytest.raises(ConnectionError):
    corpus.download(3, str(tmp_path), fetch=fetch)
  assert corpus.download(3, str(tmp_path), dry_run=True) == ["shard_00002.parquet"]
  assert corpus.download(3, str(tmp_path), fetch=fetch) == ["shard_00002.parquet"]
  assert sorted(os.listdir(tmp_path)) == corpus.climbmix_shards(3)


def test_download_command_dry_run(tmp_path):
  out = command("corpus", "download", "--shards=2",
                f"--dir={tmp_path}", "--dry_run", timeout=120)
  assert out.returncode == 0, out.stderr
  assert "would fetch karpathy/climbmix-400b-shuffle/shard_00001.parquet" in out.stdout
  assert "shard_06542.parquet" in out.stdout and not os.listdir(tmp_path)
