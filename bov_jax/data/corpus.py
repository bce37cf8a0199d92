"""Corpora: where documents come from, read a group at a time (a Parquet row group, or a
block of a text corpus), on a local disk or in a bucket (gs://, through fsspec); the
held-out split; and fetching the paper's corpus.

  data.corpus   embedded | a .txt/.jsonl file | a directory, bucket prefix or glob of
                .txt/.jsonl files or of Parquet files with a `text` column (nanochat's
                layout: shard_00000.parquet, ...)
  data.val_split
                last_shard: the last Parquet file (in name order) is the validation
                split, as the reference's dataloader takes it; every_nth: document i is
                held out iff i % data.val_every == 0; auto: last_shard for two or more
                Parquet files, every_nth otherwise

`download` (the command `python -m bov_jax.corpus download`) fetches ClimbMix
(karpathy/climbmix-400b-shuffle on the Hugging Face hub): shards 0..N-1 and the last
shard, the validation split; files already complete are kept.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import json
import os
import re
import sysconfig

import numpy as np

from bov_jax.store import storage

CLIMBMIX_REPO = "karpathy/climbmix-400b-shuffle"
CLIMBMIX_LAST_SHARD = 6542  # shard_06542.parquet: the validation split
GROUP_DOCS = 1024  # documents per group of a text corpus (a Parquet row group's size)
DOWNLOAD_HINT = ("download ClimbMix with `python -m bov_jax.corpus download --shards=N "
                 "--dir=DIR` and pass --config.data.corpus=DIR")


class DataError(ValueError):
  """A corpus setting points at nothing usable."""


class Corpus:
  """Documents in groups read whole. Group g holds documents starts[g] .. starts[g+1]-1
  (global document ids, fixed by the corpus's file order); `files` says which file each
  group comes from."""

  def __init__(self, sizes: list[int], files: list[int], read_group):
    self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    self.files = np.asarray(files)
    self._read = read_group
    if self.n_docs == 0:
      raise DataError("data.corpus holds no documents")

  @property
  def n_docs(self) -> int:
    return int(self.starts[-1])

  @property
  def n_groups(self) -> int:
    return len(self.starts) - 1

  @functools.lru_cache(maxsize=8)  # noqa: B019 - a corpus lives as long as its run
  def read(self, g: int) -> list[str]:
    return self._read(int(g))

  def group_of(self, doc: int) -> int:
    return bisect.bisect_right(self.starts, doc) - 1

  def doc(self, i: int) -> str:
    g = self.group_of(i)
    return self.read(g)[i - int(self.starts[g])]

  def documents(self):
    """Every document in corpus order."""
    for g in range(self.n_groups):
      yield from self.read(g)


def from_documents(docs: list[str]) -> Corpus:
  """A corpus of documents in memory, in groups of GROUP_DOCS."""
  sizes = [min(GROUP_DOCS, len(docs) - s) for s in range(0, len(docs), GROUP_DOCS)]
  return Corpus(sizes, [0] * len(sizes), lambda g: list(docs[g * GROUP_DOCS:(g + 1) * GROUP_DOCS]))


def _split_source(text: str, max_chars: int = 1500) -> list[str]:
  """Cuts a long source file into documents at blank lines, merged up to max_chars, so
  that packing crops little of the embedded corpus."""
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


def _decoded(path: str, raw: bytes) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise DataError(f"data.corpus: {path} line {line} is not UTF-8 (byte {e.start}: "
                    f"{raw[e.start:e.start + 4]!r}); corpus files must be UTF-8 text") from e


def _read_text_file(fs, path: str) -> list[str]:
  """A .jsonl file's documents are its lines' `text` fields; a text file's are its
  paragraphs (cut at blank lines, merged up to 1,500 characters, as the embedded corpus's),
  so that one file is a corpus and packing crops little of it."""
  text = _decoded(path, fs.cat_file(path))
  if not path.endswith((".jsonl", ".json")):
    return _split_source(text)
  docs = []
  for n, line in enumerate(text.splitlines(), 1):
    if line.strip():
      try:
        doc = json.loads(line)["text"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"data.corpus: {path} line {n} is not a JSON object with a "
                        f"'text' field ({type(e).__name__}: {e})") from e
      if not isinstance(doc, str):
        raise DataError(f"data.corpus: {path} line {n}: 'text' is a {type(doc).__name__}, "
                        "expected a string")
      docs.append(doc)
  return docs


def _bad_content(e: Exception, pa) -> bool:
  """Whether pyarrow's error is the file's content (bad input), not the storage under it
  (a lost connection, a missing permission: the environment's failure). pyarrow raises
  plain OSError for content it cannot decode, and passes a file object's own errors on."""
  return isinstance(e, (pa.ArrowException, UnicodeDecodeError)) or type(e) is OSError


def _parquet(fs, files: list[str], column: str = "text") -> Corpus:
  import pyarrow as pa
  import pyarrow.parquet as pq

  def meta(f):
    try:
      with fs.open(f, "rb") as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        rows = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    except (pa.ArrowException, OSError) as e:  # a truncated or empty file: no footer
      if not _bad_content(e, pa):
        raise
      raise DataError(f"data.corpus: {f} is not a readable Parquet file ({e})") from e
    if column not in names:
      raise DataError(f"data.corpus: {f} has no '{column}' column (columns: {names})")
    return rows

  with concurrent.futures.ThreadPoolExecutor(16) as pool:  # a bucket answers in parallel
    per_file = list(pool.map(meta, files))
  where = [(i, g) for i, rows in enumerate(per_file) for g in range(len(rows))]

  def read(g):
    i, group = where[g]
    try:
      with fs.open(files[i], "rb") as fh:
        texts = pq.ParquetFile(fh).read_row_group(group, columns=[column]).column(0).to_pylist()
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # a corrupt page or group
      if not _bad_content(e, pa):
        raise
      raise DataError(f"data.corpus: {files[i]} row group {group} cannot be read "
                      f"({type(e).__name__}: {e})") from e
    bad = next((k for k, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
      raise DataError(f"data.corpus: {files[i]} row group {group} row {bad}: '{column}' is "
                      f"{texts[bad]!r}, expected a string")
    return texts

  return Corpus([n for rows in per_file for n in rows], [i for i, _ in where], read)


def parquet_files(corpus: str) -> list[str]:
  """The Parquet files a corpus setting names, in name order ([] for other corpora)."""
  if corpus == "embedded":
    return []
  fs, files = _files(corpus)
  return [f for f in files if f.endswith(".parquet")]


def _files(corpus: str):
  fs, p = storage.filesystem(corpus)
  if fs.isdir(p):
    files = sorted(f for f in fs.find(p) if fs.isfile(f))
  else:
    files = sorted(fs.glob(p)) if any(c in p for c in "*?[") else ([p] if fs.exists(p) else [])
  if not files:
    raise DataError(f"data.corpus={corpus!r}: no such file, directory or glob match (expected "
                    "'embedded', a .txt/.jsonl/.parquet file, a directory or a glob); to train "
                    f"on the paper's corpus, {DOWNLOAD_HINT}")
  return fs, files


@functools.lru_cache(maxsize=4)
def open_corpus(corpus: str) -> Corpus:
  """The corpus a `data.corpus` setting names."""
  if corpus == "embedded":
    return from_documents(list(embedded_documents()))
  fs, files = _files(corpus)
  parquet = [f for f in files if f.endswith(".parquet")]
  texts = [f for f in files if f.endswith((".txt", ".jsonl", ".json", ".md"))]
  if parquet and texts:
    raise DataError(f"data.corpus={corpus!r} mixes Parquet and text files; use one kind")
  if parquet:
    return _parquet(fs, parquet)
  docs = [d for f in texts for d in _read_text_file(fs, f)]
  if not docs:
    raise DataError(f"data.corpus={corpus!r} holds no documents (expected .txt, .jsonl with "
                    f"a 'text' field, or .parquet with a 'text' column); {DOWNLOAD_HINT}")
  return from_documents(docs)


class Split:
  """One side of the held-out split: the groups it reads and which of their documents
  belong to it (`keep`)."""

  def __init__(self, corpus: Corpus, groups, val_every: int = 0, side: str = "train"):
    self.corpus, self.groups = corpus, np.asarray(groups, np.int64)
    self.val_every, self.side = val_every, side

  def keep(self, ids: np.ndarray) -> np.ndarray:
    if not self.val_every:
      return np.ones(len(ids), bool)
    held = ids % self.val_every == 0
    return held if self.side == "val" else ~held

  def group_docs(self, g: int):
    """(global ids, texts) of group g's documents in this split."""
    texts = self.corpus.read(g)
    ids = np.arange(self.corpus.starts[g], self.corpus.starts[g + 1])
    mask = self.keep(ids)
    return ids[mask], [t for t, m in zip(texts, mask) if m]

  def documents(self, process_index: int = 0, process_count: int = 1):
    """This process's share of the split's documents, in order: every process_count-th."""
    k = 0
    for g in self.groups:
      for text in self.group_docs(int(g))[1]:
        if k % process_count == process_index:
          yield text
        k += 1


def split(corpus: Corpus, how: str, val_every: int, n_files: int) -> tuple[Split, Split]:
  """(train, validation) under data.val_split (resolved here: `auto` needs the corpus)."""
  if how == "auto":
    how = "last_shard" if n_files >= 2 else "every_nth"
  if how == "last_shard":
    if n_files < 2:
      raise DataError(f"data.val_split='last_shard' needs two or more Parquet files in "
                      f"data.corpus; this one has {n_files}")
    last = corpus.files == corpus.files.max()
    return (Split(corpus, np.flatnonzero(~last)), Split(corpus, np.flatnonzero(last), side="val"))
  if corpus.n_docs < 2:
    raise DataError("the corpus needs at least 2 documents (one is held out for validation)")
  every = np.arange(corpus.n_groups)
  return Split(corpus, every, val_every, "train"), Split(corpus, every, val_every, "val")


# -- fetching ClimbMix --------------------------------------------------------------------

def climbmix_shards(n: int) -> list[str]:
  """Shards 0..n-1 and the last one (the validation split)."""
  ids = sorted(set(range(min(n, CLIMBMIX_LAST_SHARD))) | {CLIMBMIX_LAST_SHARD})
  return [f"shard_{i:05d}.parquet" for i in ids]


def download(shards: int, directory: str, dry_run: bool = False, fetch=None) -> list[str]:
  """Fetches the ClimbMix shards not yet complete in `directory` (a download cut short
  leaves no file under its final name, and resumes). Returns the names fetched, or with
  dry_run, the names it would fetch."""
  directory = os.path.expanduser(directory)
  missing = [n for n in climbmix_shards(shards) if not os.path.exists(os.path.join(directory, n))]
  if dry_run:
    return missing
  if fetch is None:
    from huggingface_hub import hf_hub_download

    def fetch(name):
      hf_hub_download(CLIMBMIX_REPO, name, repo_type="dataset", local_dir=directory)
  os.makedirs(directory, exist_ok=True)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    futures = [pool.submit(fetch, n) for n in missing]
  # Every shard is tried before the first failure is raised (pool.map would cancel the
  # ones not yet started), so a rerun fetches only what really failed.
  for f in futures:
    f.result()
  return missing
