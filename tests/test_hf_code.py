"""interop/hf_code/: the PyTorch model an exported folder carries, loaded by Hugging Face
transformers from the folder (trust_remote_code), against bov_jax in float32: the same
logits for every preset, the same greedy tokens as bov_jax's cached decoding, with the
cache on or off, and a cache that keeps no values for bank layers; an engine that keeps the
cache itself and packs its sequences in one row (vLLM's Transformers backend) gets the same
logits; lm-eval's own hf model on the folder agrees with bov_jax.lm_eval."""
import json
import os

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from bov_jax.data import corpus
from bov_jax.data import tokenizer as tok_lib
from bov_jax.inference import generate as inference
from bov_jax.interop import export
from bov_jax.settings import values
from bov_jax.store import checkpoint
from bov_jax.store import rundir
from tests.conftest import ROOT
from tests.helpers import random_model
from tests.helpers import slow_except
from tests.helpers import small_config

CONTEXT = 64
TASKS = os.path.join(ROOT, "tests", "data", "lm_eval")
TOLERANCE = 1e-5  # the largest logit difference, relative to the largest logit


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  """A 300-token tokenizer of the embedded corpus."""
  d = str(tmp_path_factory.mktemp("hf_tok"))
  tok_lib.train(tok_lib.training_texts(corpus.embedded_documents()[:400], 300_000), 300).save(d)
  return tok_lib.load(d)


@pytest.fixture(scope="module")
def texts():
  """Real text: four documents of the embedded corpus, each cut to the context."""
  return [d[:400] for d in corpus.embedded_documents()[10:14]]


def exported(tmp_path, tok, preset):
  """(bov_jax model, the folder export wrote, the model transformers loads from it): random
  float32 weights (every path live) at the tests' shapes, sliding windows included."""
  cfg = small_config(preset, vocab_size=tok.vocab_size, sequence_len=CONTEXT)
  assert cfg.model.dtype == "float32" and cfg.model.param_dtype == "float32"
  model = random_model(cfg, scale=0.3)
  wd, out = str(tmp_path / "run"), str(tmp_path / "hf")
  checkpoint.save_params(wd, cfg, nnx.to_pure_dict(nnx.state(model)), step=5)
  tok.save(rundir.tokenizer(wd))
  export.export(wd, out)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
  return model, out, hf.eval()


def _batch(tok, texts):
  rows = [tok.encode(t)[:CONTEXT] for t in texts]
  assert all(len(r) == CONTEXT for r in rows)
  return np.asarray(rows, np.int32)


def logit_difference(model, hf, ids) -> float:
  """max |torch - bov_jax| / max |bov_jax| over the logits of a batch of rows."""
  import jax
  ref = np.asarray(jax.jit(lambda x: model(x))(ids))
  with torch.no_grad():
    got = hf(torch.from_numpy(ids).long()).logits.numpy()
  assert got.shape == ref.shape == (*ids.shape, model.spec.vocab_size)
  return float(np.abs(got - ref).max() / np.abs(ref).max())


# One preset per kind of cache entry: none changed (baseline), a bank (table replace, its
# table shared or per layer), V1 replaced or added, x0, a table added through the gate. The
# logits test runs these in the fast subset and every other preset in the slow set.
DECODE_PRESETS = ["gpt_base", "gpt_base_v_from_value_emb_learn",
                  "gpt_base_v_from_value_emb_learn_shared", "gpt_base_v_from_v1_learn",
                  "gpt_base_add_init_v", "gpt_base_v_from_x0", "gpt_base_add_init_value_emb_nanogpt"]


@pytest.mark.parametrize("preset", slow_except(sorted(values.PRESETS), DECODE_PRESETS))
def test_the_folders_model_computes_bov_jax_logits(tmp_path, tok, texts, preset,
                                                  record_property):
  """(The measured difference is kept in --junitxml's report: docs/interop.md.)"""
  model, _, hf = exported(tmp_path, tok, preset)
  assert type(hf).__name__ == "BovGPTForCausalLM"
  difference = logit_difference(model, hf, _batch(tok, texts))
  record_property("logit_difference", difference)
  assert difference <= TOLERANCE


@pytest.mark.parametrize("preset", slow_except(  # the baseline and the paper's bank: fast
    DECODE_PRESETS, ("gpt_base", "gpt_base_v_from_value_emb_learn")))
def test_greedy_generate_gives_bov_jaxs_tokens_with_and_without_the_cache(tmp_path, tok,
                                                                          texts, preset):
  """transformers' generate, greedy, cache on and off, against bov_jax's cached decoding
  (what --mode=sample runs) from the same prompt; bank layers cache no values."""
  model, _, hf = exported(tmp_path, tok, preset)
  graphdef, params = nnx.split(model)
  prompt, n = tok.encode(texts[0])[:20], 24
  want = inference.generate_cached(graphdef, params, prompt, n, CONTEXT)
  with torch.no_grad():
    out = [hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                       use_cache=c, return_dict_in_generate=True) for c in (True, False)]
  for o in out:
    assert o.sequences[0, len(prompt):].tolist() == want
  cache = out[0].cache
  for i, layer_value in enumerate(model.spec.layers):
    stored = cache.layers[i].values
    assert cache.layers[i].keys.shape[-2] == len(prompt) + n - 1
    assert stored.shape[-1] == (model.spec.head_dim if layer_value.computes_v else 0), i
  assert cache.ids.tolist() == [out[0].sequences[0, :-1].tolist()]


class PackedEngine:
  """A reference for engines that keep the cache themselves (vLLM's Transformers backend):
  an attention-interface entry that gets each call's tokens packed in one row, keeps every
  sequence's keys and values per layer index, and attends within a sequence, causally,
  within the module's window (query i sees key j iff 0 <= i - j <= window)."""

  def __init__(self):
    self.kept, self.seqs, self.pos = {}, [], []

  def __call__(self, module, query, key, value, mask, scaling=None, **kwargs):
    assert mask is None and query.shape[0] == 1
    H, K = query.shape[1], key.shape[1]
    window = getattr(module, "window", None)
    for n, (s, p) in enumerate(zip(self.seqs, self.pos)):
      self.kept.setdefault((module.layer_idx, s), []).append((p, key[0, :, n], value[0, :, n]))
    out = []
    for n, (s, p) in enumerate(zip(self.seqs, self.pos)):
      seen = [(k, v) for q, k, v in self.kept[(module.layer_idx, s)]
              if q <= p and (window is None or p - q <= window)]
      k = torch.stack([k for k, _ in seen], 1).repeat_interleave(H // K, 0)  # [H, S, E]
      v = torch.stack([v for _, v in seen], 1).repeat_interleave(H // K, 0)
      w = torch.softmax((query[0, :, n, None] @ k.transpose(1, 2)) * scaling, -1)
      out.append((w @ v)[:, 0])  # [H, E]
    return torch.stack(out).reshape(len(out), -1), None  # [N, H * E], as vLLM returns it

  def run(self, hf, calls):
    """Each call: [(sequence, token, position)]; the logits [N, V] of every call."""
    out = []
    for call in calls:
      self.seqs, self.pos = [c[0] for c in call], [c[2] for c in call]
      ids = torch.tensor([[c[1] for c in call]])
      with torch.no_grad():
        out.append(hf(ids, position_ids=torch.tensor([self.pos]), use_cache=False).logits[0])
    return out


@pytest.mark.parametrize("preset", slow_except(  # the baseline and the paper's bank: fast
    DECODE_PRESETS, ("gpt_base", "gpt_base_v_from_value_emb_learn")))
def test_an_engine_keeping_the_cache_gets_the_folders_logits_from_packed_rows(tmp_path, tok,
                                                                             texts, preset):
  """Two sequences prefilled in chunks and decoded together, their tokens packed in each
  call's one row, every layer's cache the engine's (values for bank layers too), the smear
  gate's previous token read back from it (PreviousToken): each token's logits are the
  folder's own forward's over its whole sequence."""
  from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
  _, _, hf = exported(tmp_path, tok, preset)
  a, b = (tok.encode(t)[:CONTEXT] for t in texts[:2])
  with torch.no_grad():
    want = {s: hf(torch.tensor([ids])).logits[0] for s, ids in (("a", a), ("b", b))}
  engine = PackedEngine()
  ALL_ATTENTION_FUNCTIONS.register("bov_test_packed", engine)
  hf.config._attn_implementation = "bov_test_packed"
  tok_at = lambda s, i: ("a", a[i], i) if s == "a" else ("b", b[i], i)  # noqa: E731
  calls = [[tok_at("a", i) for i in range(20)] + [tok_at("b", i) for i in range(25)],
           [tok_at("b", i) for i in range(25, 33)] + [tok_at("a", 20)]]
  calls += [[tok_at("a", 21 + j), tok_at("b", 33 + j)] for j in range(CONTEXT - 33)]
  for call, logits in zip(calls, engine.run(hf, calls)):
    for (s, _, i), row in zip(call, logits):
      ref = want[s][i]
      assert float((row - ref).abs().max() / ref.abs().max()) <= TOLERANCE, (s, i)
  # the engine kept keys and values for every layer and the smear's, n_layer + 1
  assert {layer for layer, _ in engine.kept} == set(range(len(hf.config.window_sizes) + 1))


def test_left_padded_batches_generate_what_each_prompt_generates_alone(tmp_path, tok, texts):
  """A batch of prompts of different lengths, left-padded with an attention mask (as
  lm-eval's hf model and pipelines batch them): each row's tokens are its own alone."""
  _, out, hf = exported(tmp_path, tok, "gpt_base_v_from_value_emb_learn")
  hf_tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
  hf_tok.padding_side = "left"
  prompts = [t[:n] for t, n in zip(texts, (30, 70, 50))]
  batch = hf_tok(prompts, return_tensors="pt", padding=True)
  with torch.no_grad():
    together = hf.generate(**batch, max_new_tokens=10, do_sample=False)[:, -10:]
    for j, p in enumerate(prompts):
      alone = hf.generate(**hf_tok([p], return_tensors="pt"), max_new_tokens=10, do_sample=False)
      assert together[j].tolist() == alone[0, -10:].tolist(), j


def test_the_folders_tokenizer_encodes_as_bov_jax(tmp_path, tok, texts):
  """AutoTokenizer on the folder (transformers' own fast tokenizer: no custom code, with
  or without trust_remote_code), and that class alone: bov_jax's ids, <|bos|> in front unless special tokens are
  left out; <|bos|> is its bos, eos and padding token."""
  _, out, _ = exported(tmp_path, tok, "gpt_base")
  samples = texts + ["def f(x):\n    return x ** 2", "  ünïcode 12345 'll\n\n"]
  loaded = [transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=trust)
            for trust in (None, True)]  # None: not at a terminal, it goes on without the code
  for hf_tok in [*loaded, transformers.PreTrainedTokenizerFast.from_pretrained(out)]:
    assert hf_tok.bos_token == hf_tok.eos_token == hf_tok.pad_token == tok_lib.BOS
    assert hf_tok.bos_token_id == tok.bos_id
    for t in samples:
      assert hf_tok(t)["input_ids"] == tok.encode(t)
      assert hf_tok(t, add_special_tokens=False)["input_ids"] == tok.encode(t, bos=False)
      assert hf_tok.decode(tok.encode(t, bos=False)) == t


LM_EVAL_TASKS = ["bov_tiny_mc", "bov_tiny_gen", "bov_tiny_ppl"]  # tests/data/lm_eval


@pytest.mark.slow  # lm-eval run twice over the tasks, by each evaluator
def test_lm_evals_own_hf_model_on_the_folder_agrees_with_bov_jax_lm_eval(tmp_path, tok,
                                                                        record_property):
  """lm-eval's `hf` model (the folder loaded by transformers, as `lm_eval --model hf
  --model_args pretrained=FOLDER,trust_remote_code=True` runs it) and `bov_jax.lm_eval` on
  the same folder: the same accuracies, each request's log-likelihood within 1e-4 and the
  same greedy answer, the same generated text; and on the perplexity task, run as the
  docs' command runs it (`add_bos_token=False`: lm-eval puts its own <|bos|> in front of
  the text, so the tokenizer must not add a second), the same bits per byte within 1e-4
  and each text's log-likelihood within 1e-4."""
  from lm_eval import evaluator

  from bov_jax.evaluation import harness
  _, out, _ = exported(tmp_path, tok, "gpt_base_v_from_value_emb_learn")
  record = harness.evaluate(out, LM_EVAL_TASKS, include_path=TASKS, batch_size=8,
                            output=str(tmp_path / "bov.json"), log_samples=True, log=lambda s: s)
  bov = json.loads((tmp_path / "bov.json").read_text())
  hf = evaluator.simple_evaluate(
      model="hf", model_args=f"pretrained={out},trust_remote_code=True", device="cpu",
      batch_size=8, tasks=LM_EVAL_TASKS, task_manager=harness.task_manager(TASKS, LM_EVAL_TASKS),
      log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
      fewshot_random_seed=0)
  accuracies = {(t, m) for t in ("bov_tiny_mc", "bov_tiny_gen")
                for m in record["results"][t]
                if m.startswith(("acc", "exact_match")) and "_stderr" not in m}
  assert len(accuracies) == 3  # acc, acc_norm, exact_match
  for t, m in sorted(accuracies):
    record_property(f"{t} {m}", f"bov_jax {record['results'][t][m]} hf {hf['results'][t][m]}")
    assert record["results"][t][m] == hf["results"][t][m], (t, m)
  mc = [(s["doc_id"], s["resps"]) for s in bov["samples"]["bov_tiny_mc"]]
  hf_mc = {s["doc_id"]: s["resps"] for s in hf["samples"]["bov_tiny_mc"]}
  assert len(mc) == 24
  worst = 0.0
  for doc, resps in mc:
    for ((ll, greedy),), ((hf_ll, hf_greedy),) in zip(resps, hf_mc[doc], strict=True):
      worst = max(worst, abs(ll - hf_ll))
      assert abs(ll - hf_ll) <= 1e-4 and greedy == hf_greedy, doc
  record_property("largest log-likelihood difference", worst)
  text = {s["doc_id"]: s["resps"] for s in bov["samples"]["bov_tiny_gen"]}
  assert {s["doc_id"]: s["resps"] for s in hf["samples"]["bov_tiny_gen"]} == text
  assert any(r[0][0] for r in text.values())  # something was generated
  ppl = evaluator.simple_evaluate(
      model="hf", model_args=f"pretrained={out},trust_remote_code=True,add_bos_token=False",
      device="cpu", batch_size=8, tasks=["bov_tiny_ppl"],
      task_manager=harness.task_manager(TASKS, ["bov_tiny_ppl"]), log_samples=True)
  for m in ("bits_per_byte,none", "word_perplexity,none"):
    ours, theirs = record["results"]["bov_tiny_ppl"][m], ppl["results"]["bov_tiny_ppl"][m]
    record_property(f"bov_tiny_ppl {m}", f"bov_jax {ours} hf {theirs}")
    assert abs(ours - theirs) <= 1e-4 * max(1.0, abs(ours)), m
  ours = {s["doc_id"]: s["resps"][0][0] for s in bov["samples"]["bov_tiny_ppl"]}
  theirs = {s["doc_id"]: s["resps"][0][0] for s in ppl["samples"]["bov_tiny_ppl"]}
  assert ours.keys() == theirs.keys() and len(ours) >= 2
  for doc, ll in ours.items():
    assert abs(ll - theirs[doc]) <= 1e-4, doc
