"""CORE evaluation on small bundles written in the real DCLM/nanochat file formats."""
import json
import os

import numpy as np
import pytest

from bov_jax.evaluation import core as ev
from tests.helpers import write_authors_bundle


class CharTok:
  """A character-level stand-in tokenizer: id = ord(c) + 1, BOS = 0."""
  bos_id = 0

  def encode(self, text, bos=True):
    return ([0] if bos else []) + [ord(c) + 1 for c in text]

  def decode(self, ids):
    return "".join(chr(i - 1) for i in ids if i > 0)


MC = ev.Task("mc", "mc.jsonl", 2, "multiple_choice", delimiter=" -> ", random_baseline=25.0)
SCHEMA = ev.Task("schema", "schema.jsonl", 1, "schema", delimiter=" ", random_baseline=50.0)
LM = ev.Task("lm", "lm.jsonl", 1, "language_modeling", delimiter=" ", random_baseline=0.0)


def write_bundle(root):
  os.makedirs(os.path.join(root, "eval_data", "sub"), exist_ok=True)
  (root / "core.yaml").write_text(
      "icl_tasks:\n"
      "- label: mc\n  dataset_uri: sub/mc.jsonl\n  num_fewshot: [2]\n"
      "  icl_task_type: multiple_choice\n  continuation_delimiter: ' -> '\n"
      "- label: schema\n  dataset_uri: schema.jsonl\n  num_fewshot: [1]\n"
      "  icl_task_type: schema\n"
      "- label: lm\n  dataset_uri: lm.jsonl\n  num_fewshot: [0, 1]\n"
      "  icl_task_type: language_modeling\n")
  (root / "eval_meta_data.csv").write_text(
      "Eval Task,Task Category,Random baseline\nmc,x,25.0\nschema,y,50\nlm,z,0\n")
  mc = [{"query": f"Q{i}: what is {i}+{i}?", "choices": [str(2 * i), str(2 * i + 1), "x", "y"],
         "gold": 0} for i in range(6)]
  schema = [{"context_options": [f"The cat {i}", f"The dog {i}"], "continuation": "barked.",
             "gold": 1} for i in range(5)]
  lm = [{"context": f"  count {i} ", "continuation": f"{i + 1}"} for i in range(4)]
  for name, items in (("sub/mc.jsonl", mc), ("schema.jsonl", schema), ("lm.jsonl", lm)):
    with open(root / "eval_data" / name, "w") as f:
      f.writelines(json.dumps(x) + "\n" for x in items)


def test_the_authors_task_list_is_the_default(tmp_path):
  write_authors_bundle(tmp_path)
  tasks = ev.load_bundle(str(tmp_path))  # the bundle's own core.yaml (copa at 7) is ignored
  by = {t.label: t for t in tasks}
  assert len(tasks) == 21 and "hellaswag_zeroshot" not in by
  assert by["arc_easy"].num_fewshot == by["arc_challenge"].num_fewshot == 25
  assert by["winogrande"].num_fewshot == 5 and by["copa"].num_fewshot == 0
  assert by["agi_eval_lsat_ar"].num_fewshot == 3 and by["squad"].num_fewshot == 10
  assert by["piqa"].delimiter == "\nAnswer: " and by["boolq"].delimiter == "\nAnswer: "
  assert by["jeopardy"].delimiter == "\nAnswer: " and by["copa"].delimiter == " "
  assert by["winograd"].task_type == by["winogrande"].task_type == "schema"
  own = ev.load_bundle(str(tmp_path), core_config=str(tmp_path / "core.yaml"))
  assert [(t.label, t.num_fewshot) for t in own] == [("copa", 7)]  # named: used
  (tmp_path / "eval_data" / "reading_comprehension" / "squad.jsonl").unlink()
  with pytest.raises(ev.BundleError, match=r"task 'squad' needs .*squad\.jsonl, which is missing"):
    ev.load_bundle(str(tmp_path))


def test_bundle_parsing(tmp_path):
  write_bundle(tmp_path)
  tasks = ev.load_bundle(str(tmp_path), str(tmp_path / "core.yaml"))
  assert [t.label for t in tasks] == ["mc", "schema", "lm_0shot", "lm_1shot"]
  assert tasks[0].delimiter == " -> " and tasks[1].delimiter == " "
  assert tasks[0].random_baseline == 25.0 and tasks[0].num_fewshot == 2
  items = ev.load_items(str(tmp_path), tasks[0], max_per_task=3)
  assert len(items) == 3 and items == ev.load_items(str(tmp_path), tasks[0], 3)  # fixed shuffle


def test_bundle_errors(tmp_path):
  with pytest.raises(ev.BundleError, match="missing eval_meta_data.csv"):
    ev.load_bundle(str(tmp_path))
  with pytest.raises(ev.BundleError, match=r"eval\.core_config=/no/such\.yaml: no such file"):
    ev.load_bundle(str(tmp_path), "/no/such.yaml")
  write_bundle(tmp_path)
  (tmp_path / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,25\n")
  with pytest.raises(ev.BundleError, match="no 'Random baseline' for task 'schema'"):
    ev.load_bundle(str(tmp_path), str(tmp_path / "core.yaml"))


def test_render_with_fewshot_and_delimiters():
  items = [{"query": "A?", "choices": ["a1", "a2"], "gold": 1},
           {"query": "B?", "choices": ["b1", "b2"], "gold": 0},
           {"query": "C?", "choices": ["c1", "c2"], "gold": 0}]
  shots = ev.fewshot_examples(items, 2, 2)
  assert items[2] not in shots and len(shots) == 2
  assert shots == ev.fewshot_examples(items, 2, 2)  # seeded per item
  p = ev.render(MC, items[2], [items[0], items[1]])
  assert p == ["A? -> a2\n\nB? -> b1\n\nC? -> c1", "A? -> a2\n\nB? -> b1\n\nC? -> c2"]
  s = ev.render(SCHEMA, {"context_options": ["x1", "x2"], "continuation": "end", "gold": 0},
                [{"context_options": ["e1", "e2"], "continuation": "fin", "gold": 1}])
  assert s == ["e2 fin\n\nx1 end", "e2 fin\n\nx2 end"]
  lm = ev.render(LM, {"context": "  hello ", "continuation": "world"},
                 [{"context": " ex ", "continuation": "ample"}])
  assert lm == ["ex ample\n\nhello", "ex ample\n\nhello world"]


def test_common_prefix_and_suffix_spans():
  tok = CharTok()
  mc = ev.spans(MC, ["Q -> yes", "Q -> no"], tok)
  assert mc.starts == [6, 6] and mc.ends == [9, 8]  # BOS + "Q -> " shared, then the choice
  sc = ev.spans(SCHEMA, ["cat end", "a dog end"], tok)
  assert sc.ends == [8, 10] and sc.starts == [4, 6]  # the shared suffix is " end"
  lm = ev.spans(LM, ["ctx", "ctx more"], tok)
  assert lm.tokens == [tok.encode("ctx more")] and lm.starts == [4] and lm.ends == [9]


def test_byte_normalised_choice():
  tok = CharTok()

  class FakeScorer:
    def __init__(self, nll):
      self.nll = nll

    def __call__(self, rows):
      return [(np.full(len(r) - 1, v), np.zeros(len(r) - 1, np.int64))
              for r, v in zip(rows, self.nll)]

  s = ev.spans(MC, ["Q -> aaaa", "Q -> b"], tok)
  # per token nll 1.0 for choice 0 (4 bytes: sum 4 -> 1.0/byte), 1.5 for choice 1 (1 byte)
  assert ev.score_item(MC, s, FakeScorer([1.0, 1.5]), tok, gold=0)
  # summed NLL alone would pick choice 1 (1.5 < 4.0); per byte it is 1.0 < 1.5
  assert not ev.score_item(MC, s, FakeScorer([1.0, 1.5]), tok, gold=1)


def test_lm_exact_match():
  tok = CharTok()
  s = ev.spans(LM, ["ctx", "ctx ab"], tok)  # continuation " ab" at positions 4..6

  class Pred:
    def __init__(self, seq):
      self.seq = seq

    def __call__(self, rows):
      pred = np.asarray(self.seq[1:])  # position i predicts token i+1
      return [(np.zeros(len(pred)), pred)]

  full = tok.encode("ctx ab")
  assert ev.score_item(LM, s, Pred(full), tok, None)
  wrong = list(full)
  wrong[-1] = tok.encode("z", bos=False)[0]
  assert not ev.score_item(LM, s, Pred(wrong), tok, None)
  wrong_ctx = list(full)
  wrong_ctx[1] = 99  # a wrong prediction inside the context does not count
  assert ev.score_item(LM, s, Pred(wrong_ctx), tok, None)


def test_centered_accuracy():
  assert ev.centered(0.25, 25.0) == pytest.approx(0.0)
  assert ev.centered(1.0, 25.0) == pytest.approx(1.0)
  assert ev.centered(0.625, 25.0) == pytest.approx(0.5)
  assert ev.centered(0.3, 0.0) == pytest.approx(0.3)


@pytest.mark.slow
def test_a_prompt_longer_than_the_training_length_is_scored_whole():
  """Positions past model.sequence_len run as the reference runs them: the whole prompt,
  BOS first, no cut; the NLL of each position equals the model's on the unpadded row."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from tests.helpers import init_model
  from tests.helpers import small_config
  m = init_model(small_config("gpt_base_v_from_value_emb_learn", vocab_size=200,
                              sequence_len=64), jax.random.key(0))
  graphdef, state = nnx.split(m)
  tok = CharTok()
  s = ev.spans(LM, ["ab " * 50, "ab " * 50 + " cd"], tok)  # 150 context tokens > 64
  assert len(s.tokens[0]) > 150 and s.tokens[0][0] == 0
  scorer = ev.Scorer(graphdef, nnx.to_pure_dict(state), pad_id=0)
  ((nll, _),) = scorer(s.tokens)
  assert scorer.shapes == {(4, 256)}  # the bucket holds the whole row
  row = jnp.asarray([s.tokens[0]], jnp.int32)
  logits = np.asarray(m(row))[0]
  want = jax.nn.logsumexp(logits, axis=-1)[:-1] - logits[np.arange(len(row[0]) - 1), row[0, 1:]]
  assert nll.shape == (len(row[0]) - 1,)
  np.testing.assert_allclose(nll, np.asarray(want), rtol=1e-4, atol=1e-4)


def test_core_end_to_end_with_a_model(tmp_path):
  import jax
  from flax import nnx

  from tests.helpers import init_model
  from tests.helpers import small_config
  write_bundle(tmp_path)
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=200, sequence_len=64)
  m = init_model(cfg, jax.random.key(0))
  graphdef, state = nnx.split(m)

  class ClippedTok(CharTok):
    def encode(self, text, bos=True):
      return [min(i, 199) for i in super().encode(text, bos)]

  res = ev.core(str(tmp_path), graphdef, nnx.to_pure_dict(state), ClippedTok(),
                core_config=str(tmp_path / "core.yaml"), log=lambda *_: None)
  assert set(res["core_tasks"]) == {"mc", "schema", "lm_0shot", "lm_1shot"}
  assert np.isfinite(res["core"])
  assert res["core_tasks"]["mc"]["shots"] == 2 and res["core_tasks"]["lm_1shot"]["shots"] == 1
  for r in res["core_tasks"].values():
    assert 0.0 <= r["accuracy"] <= 1.0


def test_a_batch_pads_to_few_shapes():
  assert ev.padded_shape(5, 65) == (8, 128) and ev.padded_shape(4, 10) == (4, 64)
  assert ev.padded_shape(1, 300, most=256) == (4, 256)  # no longer than the context
