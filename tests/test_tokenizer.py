"""The authors' tokenizer: rustbpe training, tiktoken encoding, nanochat's files."""
import json
import os
import pickle

import numpy as np
import pytest

from bov_jax.data import corpus
from bov_jax.data import tokenizer as tok_lib
from tests.helpers import command


@pytest.fixture(scope="module")
def docs():
  return list(corpus.embedded_documents()[:3000])


@pytest.fixture(scope="module")
def tok(docs):
  return tok_lib.train(tok_lib.training_texts(docs, 1_000_000), 512)


def test_specials_at_top_and_round_trip(tok):
  assert tok.vocab_size == 512 and tok.bos_id == 512 - 9
  assert tok.enc.encode_single_token("<|output_end|>") == 511
  text = "def f(x):\n    return x ** 2  # ünïcode 12345\n"
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == text
  pieces = [tok.enc.decode([i]) for i in tok.encode("1234567", bos=False)]
  assert all(len(p) <= 2 for p in pieces)  # \p{N}{1,2}


def test_document_text_never_becomes_a_special_token(tok):
  ids = tok.encode("a <|bos|> b <|assistant_end|>", bos=False)
  assert not set(ids) & set(range(512 - 9, 512))
  assert tok.decode(ids) == "a <|bos|> b <|assistant_end|>"
  texts = ["<|bos|>", "x <|user_start|> y", "plain"]
  assert [ids.tolist() for ids in tok.encode_batch(texts)] == [tok.encode(t) for t in texts]
  assert all(tok.bos_id not in ids[1:] for ids in tok.encode_batch(texts))


def test_token_bytes(tok):
  tb = tok.token_bytes()
  assert tb.shape == (512,) and np.all(tb[-9:] == 0)
  for i in (0, 100, 300, 500):
    assert tb[i] == len(tok.enc.decode([i]).encode("utf-8"))
  assert tb[tok.encode("hello world", bos=False)].sum() == len("hello world")


def test_the_tokenizers_library_encodes_as_bov_jax(tok, docs, tmp_path):
  """hf_json: tokenizers.Tokenizer.from_file reads it and gives bov_jax's ids (BOS in
  front, or not) on unseen documents, code, digits, unicode and whitespace runs; decodes
  back to the text; a special token's text stays text with encode_special_tokens."""
  import tokenizers  # the dev extra installs it: the file must read in the library itself
  (tmp_path / "tokenizer.json").write_text(json.dumps(tok_lib.hf_json(tok)))
  hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  texts = list(corpus.embedded_documents()[3000:3300]) + [
      "def f(x):\n    return x ** 2  # ünïcode 12345\n", "  lead  \n\n\ttabs 1234567 'll 'S",
      "😀 emoji 中文 ", "", "a\r\n\r\nb   "]
  for text in texts:
    assert hf.encode(text).ids == tok.encode(text), text[:60]
    assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text, bos=False)
    assert hf.decode(tok.encode(text, bos=False)) == text
  assert hf.token_to_id("<|bos|>") == tok.bos_id and hf.get_vocab_size() == tok.vocab_size
  hf.encode_special_tokens = True
  assert hf.encode("a <|bos|> b").ids == tok.encode("a <|bos|> b")


def test_a_vocabulary_that_is_not_bpe_is_refused():
  with pytest.raises(tok_lib.TokenizerError, match="not a merge"):
    tok_lib._merge_of({b"a": 0, b"b": 1, b"abc": 2}, b"abc")


def _reference_recipe(texts, vocab_size):
  """The authors' recipe, written out from their tokenizer.py: rustbpe to vocab_size minus
  the nine specials, then a tiktoken Encoding over its ranks with the specials on top."""
  import rustbpe
  import tiktoken
  bpe = rustbpe.Tokenizer()
  bpe.train_from_iterator(iter(texts), vocab_size - 9, pattern=tok_lib.SPLIT_PATTERN)
  ranks = {bytes(k): v for k, v in bpe.get_mergeable_ranks()}
  specials = {s: len(ranks) + i for i, s in enumerate(tok_lib.RESERVED_TOKENS)}
  return tiktoken.Encoding(name="rustbpe", pat_str=bpe.get_pattern(), mergeable_ranks=ranks,
                           special_tokens=specials)


def test_training_equals_the_reference_recipe_token_for_token(docs, tok):
  """The same documents (in order, each cut at doc_cap, up to max_chars) and settings."""
  capped, n = [], 0
  for d in docs:  # the reference's text iterator
    capped.append(d[:10_000])
    n += len(capped[-1])
    if n > 1_000_000:
      break
  ref = _reference_recipe(capped, 512)
  assert ref._mergeable_ranks == tok.enc._mergeable_ranks
  tail = docs[3000 - 50:]
  for text, batch in zip(tail, tok.encode_batch(tail, bos=False)):
    assert tok.encode(text, bos=False) == ref.encode_ordinary(text) == batch.tolist()
  assert list(tok_lib.training_texts(["abcdef", "gh", "ijk"], 7, doc_cap=4)) == ["abcd", "gh", "ijk"]


def test_a_nanochat_tokenizer_pkl_loads_and_encodes_as_tiktoken(tmp_path, docs):
  ref = _reference_recipe(docs[:500], 300)
  (tmp_path / "tokenizer.pkl").write_bytes(pickle.dumps(ref))  # as nanochat saves it
  for path in (tmp_path, tmp_path / "tokenizer.pkl"):
    tok = tok_lib.load(str(path))
    text = docs[1234]
    assert tok.encode(text) == [ref.encode_single_token("<|bos|>")] + ref.encode_ordinary(text)
  with pytest.raises(tok_lib.TokenizerError, match="no tokenizer.pkl"):
    tok_lib.load(str(tmp_path / "nothing"))


def test_save_load_round_trip(tmp_path, tok):
  tok.save(str(tmp_path / "t"))
  back = tok_lib.load(str(tmp_path / "t"))
  assert back.encode("x = [1, 2]") == tok.encode("x = [1, 2]")
  np.testing.assert_array_equal(np.load(tmp_path / "t" / "token_bytes.npy"), tok.token_bytes())
  with pytest.raises(tok_lib.TokenizerError, match="model.vocab_size=600"):
    tok_lib.checked(back, "t", 600)


def test_the_commands_train_and_encode(tmp_path):
  (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                            for d in corpus.embedded_documents()[:400]))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = command("tokenizer", "train",
                f"--corpus={tmp_path}/c.jsonl", "--vocab_size=300", "--max_chars=200000",
                "--doc_cap=10000", f"--out={tmp_path}/tok", env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  out = command("tokenizer", "encode",
                f"--tokenizer={tmp_path}/tok", "--bos", input="def main():", env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  ids = json.loads(out.stdout)
  tok = tok_lib.load(str(tmp_path / "tok"))
  assert ids == tok.encode("def main():") and ids[0] == tok.bos_id
