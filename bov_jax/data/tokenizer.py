"""The authors' tokenizer: byte-level BPE trained with rustbpe, encoded with tiktoken, saved
in nanochat's format (the reference's nanochat/tokenizer.py and scripts/tok_train.py).

GPT-4-style split pattern with `\\p{N}{1,2}`; the nine special tokens sit at the top of the
vocabulary (trained merges first); `<|bos|>` starts every document. Text is encoded with
`encode_ordinary`, so document text never turns into a special token. A tokenizer is a
directory holding `tokenizer.pkl` (a pickled tiktoken Encoding) and `token_bytes.npy`;
`hf_json` writes the same tokenizer in the Hugging Face `tokenizers` library's format.


The command `python -m bov_jax.tokenizer` trains one on a corpus or encodes text.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from typing import Iterable

import numpy as np
from etils import epath

SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
                 r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
RESERVED_TOKENS = [  # nanochat's special tokens, in its order
    "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
BOS = "<|bos|>"
TOKEN_BYTES = "token_bytes.npy"
PICKLE = "tokenizer.pkl"
DOC_CAP = 10_000  # the reference trains on each document's first 10,000 characters


class TokenizerError(ValueError):
  """A tokenizer setting or file that cannot be used."""


class Tokenizer:
  """A tiktoken Encoding with BOS handling, batch encoding and token byte lengths."""

  def __init__(self, enc):
    self.enc = enc
    try:
      self.bos_id = enc.encode_single_token(BOS)
    except KeyError as e:
      raise TokenizerError(f"tokenizer {enc.name!r} has no {BOS} token") from e

  @property
  def vocab_size(self) -> int:
    return self.enc.n_vocab

  def encode(self, text: str, bos: bool = True) -> list[int]:
    ids = self.enc.encode_ordinary(text)
    return [self.bos_id] + ids if bos else ids

  def encode_batch(self, texts: list[str], bos: bool = True) -> list[np.ndarray]:
    """Many documents at once, as int32 arrays, on a thread per core. Straight into numpy
    (tiktoken's buffer, no special tokens allowed: encode_ordinary's ids): lists of ints
    and their conversion cost as much again as the encoding."""
    return list(self.encode_batch_started(texts, bos))

  def encode_batch_started(self, texts: list[str], bos: bool = True):
    """encode_batch, started on the threads and not waited for: an iterator of the arrays
    in order, each waited for when it is read."""
    head = np.asarray([self.bos_id] if bos else [], np.int32)

    def one(text):
      ids = self.enc.encode_to_numpy(text, disallowed_special=()).view(np.int32)
      return np.concatenate([head, ids]) if bos else ids
    return _pool().map(one, texts)

  def decode(self, ids, special: bool = True) -> str:
    """The text of `ids`; special=False leaves the special tokens out (as transformers'
    decode(skip_special_tokens=True), which lm-eval's hf model decodes with)."""
    ids = [int(i) for i in ids]
    if not special:
      ids = [i for i in ids if i not in self.special_ids]
    return self.enc.decode(ids)

  @functools.cached_property
  def special_ids(self) -> frozenset[int]:
    return frozenset(self.enc.encode_single_token(s) for s in self.enc.special_tokens_set)

  @functools.cache  # noqa: B019 - a tokenizer lives as long as its run
  def token_bytes(self) -> np.ndarray:
    """UTF-8 byte length of each decoded token; 0 for special tokens (as the reference
    computes it for bits per byte: decode to text, then encode)."""
    special = set(self.enc.special_tokens_set)
    out = np.zeros(self.vocab_size, np.int32)
    for i in range(self.vocab_size):
      text = self.enc.decode([i])
      if text not in special:
        out[i] = len(text.encode("utf-8"))
    return out

  def save(self, directory: str) -> None:
    """tokenizer.pkl (what nanochat loads) and token_bytes.npy (nanochat writes a torch
    tensor, token_bytes.pt; here it is recomputed from the encoding on load anyway)."""
    d = epath.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / PICKLE).write_bytes(pickle.dumps(self.enc))
    buf = io.BytesIO()
    np.save(buf, self.token_bytes())
    (d / TOKEN_BYTES).write_bytes(buf.getvalue())


# -- the Hugging Face `tokenizers` format ---------------------------------------------

def _byte_chars() -> list[str]:
  """GPT-2's byte-level alphabet: byte b is written as this printable character in the
  vocabulary and merges of a `tokenizers` byte-level BPE."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  extra = iter(range(256, 512))
  return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _merge_of(ranks: dict, token: bytes) -> tuple[bytes, bytes]:
  """The pair whose merge made `token`: BPE on its bytes with only the merges ranked
  below it (tiktoken stores ranks, not merges; the rank order is the merge order)."""
  parts, limit = [bytes([b]) for b in token], ranks[token]
  while len(parts) > 2:
    best = min(((ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))))
    if best[0] >= limit:
      break
    i = best[1]
    parts[i:i + 2] = [parts[i] + parts[i + 1]]
  if len(parts) != 2:
    raise TokenizerError(f"token {token!r} (rank {limit}) is not a merge of two lower-ranked "
                         "tokens: not a BPE vocabulary")
  return parts[0], parts[1]


def hf_json(tok: Tokenizer) -> dict:
  """The tokenizer as the `tokenizers` library's tokenizer.json: the split pattern, then
  byte-level BPE over the same ranks (whole pieces found in the vocabulary first, as
  tiktoken does), the specials as added tokens, <|bos|> in front of every encoding
  (`add_special_tokens=False` leaves it out, as `encode(bos=False)`). One difference: the
  library reads a special token's text in the input as that token unless
  `encode_special_tokens` is set, while bov_jax never does (encode_ordinary)."""
  enc = tok.enc
  chars = _byte_chars()
  ranks = enc._mergeable_ranks  # tiktoken keeps no public accessor for the ranks
  word = lambda b: "".join(chars[x] for x in b)
  vocab = {word(t): r for t, r in ranks.items()}
  merges = [[word(a), word(b)] for a, b in (
      _merge_of(ranks, t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])
      if len(t) > 1)]
  specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
  vocab.update(dict(specials))
  bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
  return {
      "version": "1.0", "truncation": None, "padding": None,
      "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False,
                        "rstrip": False, "normalized": False, "special": True}
                       for s, i in specials],
      "normalizer": None,
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
          {"type": "Split", "pattern": {"Regex": enc._pat_str}, "behavior": "Isolated",
           "invert": False},
          {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
           "use_regex": False}]},
      "post_processor": {
          "type": "TemplateProcessing",
          "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
          "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                   {"Sequence": {"id": "B", "type_id": 1}}],
          "special_tokens": {BOS: {"id": BOS, "ids": [tok.bos_id], "tokens": [BOS]}}},
      "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False},
      "model": {"type": "BPE", "dropout": None, "unk_token": None,
                "continuing_subword_prefix": None, "end_of_word_suffix": None,
                "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                "vocab": vocab, "merges": merges}}


@functools.cache
def _pool():
  import concurrent.futures
  return concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1,
                                               thread_name_prefix="bov_jax_tokenizer")


def training_texts(docs: Iterable[str], max_chars: int, doc_cap: int = DOC_CAP):
  """The reference's trainer input: documents in order, each cut to its first `doc_cap`
  characters, until more than `max_chars` characters have been given."""
  n = 0
  for doc in docs:
    text = doc[:doc_cap]
    n += len(text)
    yield text
    if n > max_chars:
      return


def check_trainable(vocab_size: int) -> None:
  """A vocabulary BPE can be trained to: the 256 bytes and the specials at least."""
  if vocab_size < 256 + len(RESERVED_TOKENS):
    raise TokenizerError(f"model.vocab_size={vocab_size} must be at least "
                         f"{256 + len(RESERVED_TOKENS)} (256 bytes + {len(RESERVED_TOKENS)} "
                         "specials) for a tokenizer trained on the corpus")


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """rustbpe trained on `texts` to vocab_size - 9 merges and bytes, then the specials."""
  import rustbpe
  import tiktoken
  check_trainable(vocab_size)
  n_merges = vocab_size - len(RESERVED_TOKENS)
  bpe = rustbpe.Tokenizer()
  bpe.train_from_iterator(iter(texts), n_merges, pattern=SPLIT_PATTERN)
  ranks = {bytes(k): v for k, v in bpe.get_mergeable_ranks()}
  if len(ranks) != n_merges:
    raise TokenizerError(f"the corpus is too small for a {vocab_size}-token vocabulary: BPE "
                         f"found only {len(ranks)} tokens; lower model.vocab_size")
  specials = {name: len(ranks) + i for i, name in enumerate(RESERVED_TOKENS)}
  enc = tiktoken.Encoding(name="rustbpe", pat_str=bpe.get_pattern(), mergeable_ranks=ranks,
                          special_tokens=specials)
  return Tokenizer(enc)


def load(path: str) -> Tokenizer:
  """A saved tokenizer: a directory holding tokenizer.pkl (ours or nanochat's), or the file."""
  p = epath.Path(path)
  if p.is_dir():
    p = p / PICKLE
  if not p.exists():
    raise TokenizerError(f"{path}: no {PICKLE} (expected a tokenizer directory or its "
                         f"{PICKLE}, as nanochat and bov_jax save them)")
  return Tokenizer(pickle.loads(p.read_bytes()))


def checked(tok: Tokenizer, where: str, vocab_size: int) -> Tokenizer:
  if tok.vocab_size != vocab_size:
    raise TokenizerError(f"{where} has {tok.vocab_size} tokens but model.vocab_size="
                         f"{vocab_size}; use the matching vocab_size")
  return tok
