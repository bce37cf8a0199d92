"""Command: the authors' tokenizer trained on a corpus, or text encoded with one
(data/tokenizer.py).

  python -m bov_jax.tokenizer train --corpus=PATH --out=DIR [--vocab_size=32768]
      [--max_chars=N] [--doc_cap=N]
  python -m bov_jax.tokenizer encode --tokenizer=PATH [--bos] < text
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.data import corpus
from bov_jax.data import tokenizer as tok_lib

_CORPUS = flags.DEFINE_string("corpus", None, "train: data.corpus to read documents from, in order")
_VOCAB = flags.DEFINE_integer("vocab_size", 32768, "train: vocabulary size, specials included")
_MAX_CHARS = flags.DEFINE_integer("max_chars", 2_000_000_000, "train: characters of text to "
                                  "train on")
_DOC_CAP = flags.DEFINE_integer("doc_cap", tok_lib.DOC_CAP, "train: characters kept of each "
                                "document")
_OUT = flags.DEFINE_string("out", None, "train: the directory to save the tokenizer in")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "encode: a tokenizer directory or "
                                 "tokenizer.pkl")
_BOS = flags.DEFINE_bool("bos", False, "encode: prepend <|bos|>")


def main(argv) -> int:
  if len(argv) != 2 or argv[1] not in ("train", "encode"):
    raise app.UsageError("usage: python -m bov_jax.tokenizer {train|encode} [flags]")
  if argv[1] == "train" and (not _CORPUS.value or not _OUT.value):
    raise app.UsageError("train needs --corpus=PATH and --out=DIR")
  if argv[1] == "encode" and not _TOKENIZER.value:
    raise app.UsageError("encode needs --tokenizer=PATH")
  try:
    if argv[1] == "train":
      docs = corpus.open_corpus(_CORPUS.value).documents()
      tok = tok_lib.train(tok_lib.training_texts(docs, _MAX_CHARS.value, _DOC_CAP.value),
                          _VOCAB.value)
      tok.save(_OUT.value)
      print(json.dumps({"tokenizer": _OUT.value, "vocab_size": tok.vocab_size}))
    else:
      print(json.dumps(tok_lib.load(_TOKENIZER.value).encode(sys.stdin.read(), bos=_BOS.value)))
  except (ValueError, OSError) as e:  # bad input (2), or it failed (1)
    return cli.failed(e)
  return 0


if __name__ == "__main__":
  cli.run(lambda argv: sys.exit(main(argv)))
