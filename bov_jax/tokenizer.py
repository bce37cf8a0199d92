"""Byte-level BPE (the reference's tokenizer.py recipe), trained with HF `tokenizers` and
kept in the workdir.

GPT-4-style split regex with `\\p{N}{1,2}`; the special tokens sit at the top of the
vocabulary (trained merges first, then the 9 specials), `<|bos|>` starts every document.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
                 r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
RESERVED_TOKENS = [  # nanochat's special tokens, in its order
    "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
BOS = "<|bos|>"
FILENAME = "tokenizer.json"


class BPETokenizer:
  """A thin wrapper: encode with BOS, decode, token_bytes for bits per byte."""

  def __init__(self, tok: Tokenizer):
    self.tok = tok
    self.bos_id = tok.token_to_id(BOS)
    if self.bos_id is None:
      raise ValueError("tokenizer has no <|bos|> token")

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size()

  def encode(self, text: str, bos: bool = True) -> list[int]:
    ids = self.tok.encode(text, add_special_tokens=False).ids
    return [self.bos_id] + ids if bos else ids

  def encode_batch(self, texts: list[str], bos: bool = True) -> list[list[int]]:
    out = self.tok.encode_batch(texts, add_special_tokens=False)
    return [([self.bos_id] if bos else []) + e.ids for e in out]

  def decode(self, ids) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def token_bytes(self) -> np.ndarray:
    """UTF-8 byte length of each decoded token; 0 for special tokens (bits per byte)."""
    special = {self.tok.token_to_id(s) for s in RESERVED_TOKENS}
    out = np.zeros(self.vocab_size, np.int32)
    for i in range(self.vocab_size):
      if i not in special:
        out[i] = len(self.tok.decode([i]).encode("utf-8"))
    return out

  def save(self, path: str) -> None:
    from etils import epath  # local paths and gs:// alike
    tmp = epath.Path(path + ".tmp")
    tmp.write_text(self.tok.to_str())
    tmp.replace(path)  # atomic on local disks: a reader never sees half a file


def train(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
  n_merges = vocab_size - len(RESERVED_TOKENS)
  if n_merges < 256:
    raise ValueError(f"tokenizer vocab_size={vocab_size} must be at least "
                     f"{256 + len(RESERVED_TOKENS)} (256 bytes + {len(RESERVED_TOKENS)} specials)")
  tok = Tokenizer(models.BPE(byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=n_merges, show_progress=False, min_frequency=0,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                special_tokens=[])
  tok.train_from_iterator(texts, trainer=trainer)
  if tok.get_vocab_size() != n_merges:
    raise ValueError(f"the corpus is too small for a {vocab_size}-token vocabulary: BPE "
                     f"found only {tok.get_vocab_size()} tokens; lower model.vocab_size")
  tok.add_special_tokens(RESERVED_TOKENS)  # appended: ids vocab_size-9 .. vocab_size-1
  return BPETokenizer(tok)


def load(path: str) -> BPETokenizer:
  from etils import epath
  return BPETokenizer(Tokenizer.from_str(epath.Path(path).read_text()))


def _checked(tok: BPETokenizer, path: str, vocab_size: int) -> BPETokenizer:
  if tok.vocab_size != vocab_size:
    raise ValueError(f"{path} has {tok.vocab_size} tokens but model.vocab_size={vocab_size}; "
                     "use a fresh --workdir or the matching vocab_size")
  return tok


def load_from_workdir(workdir: str, vocab_size: int) -> BPETokenizer:
  """A run's tokenizer (evaluation, sampling): an error naming the file if it is missing."""
  from etils import epath
  path = os.path.join(workdir, FILENAME)
  if not epath.Path(path).exists():
    raise FileNotFoundError(f"--workdir={workdir} has no {FILENAME} (the run's tokenizer)")
  return _checked(load(path), path, vocab_size)


def load_or_train(workdir: str | None, texts_fn, vocab_size: int) -> BPETokenizer:
  """The workdir's tokenizer if there is one (checked against vocab_size), else a new one."""
  from etils import epath
  path = os.path.join(workdir, FILENAME) if workdir else None
  if path and epath.Path(path).exists():
    return _checked(load(path), path, vocab_size)
  tok = train(texts_fn(), vocab_size)
  if path:
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    tok.save(path)
  return tok
