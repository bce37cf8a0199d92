"""lm_eval.py: lm-eval-harness's model interface over a run directory or an exported
folder; its numbers are the model's own."""
import json
import os
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance

from bov_jax.data import corpus
from bov_jax.data import tokenizer as tok_lib
from bov_jax.evaluation import harness as lm_eval
from bov_jax.inference import generate as inference
from bov_jax.jobs import modes
from bov_jax.run import spec as spec_lib
from bov_jax.store import checkpoint
from bov_jax.store import rundir
from tests.conftest import ROOT
from tests.helpers import command
from tests.helpers import command_env
from tests.helpers import free_port
from tests.helpers import random_model
from tests.helpers import small_config
from tests.helpers import start

TASKS = os.path.join(ROOT, "tests", "data", "lm_eval")
CONTEXT = 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run directory: a BoV model's checkpoint (random weights, every path live) and a
  300-token tokenizer of the embedded corpus."""
  wd = str(tmp_path_factory.mktemp("lm_eval") / "run")
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=300, sequence_len=CONTEXT)
  model = random_model(cfg)
  checkpoint.save_params(wd, cfg, nnx.to_pure_dict(nnx.state(model)), step=7)
  texts = tok_lib.training_texts(corpus.embedded_documents()[:400], 300_000)
  tok_lib.train(texts, 300).save(rundir.tokenizer(wd))
  return wd, model


@pytest.fixture(scope="module")
def lm(run):
  return lm_eval.BovLM(run[0], batch_size=8, decode_chunk=4)


def _request(kind, args):
  return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _own_loglikelihood(model, rows):
  """-sum of model.token_losses over each row's scored targets: rows of (inputs, targets
  with -1 where nothing is scored), run as one [rows, CONTEXT] batch (padding scores
  nothing and, the model being causal, changes nothing before it)."""
  inputs = np.zeros((len(rows), CONTEXT), np.int32)
  targets = np.full((len(rows), CONTEXT), -1, np.int32)
  for i, (x, t) in enumerate(rows):
    inputs[i, :len(x)], targets[i, :len(t)] = x, t
  nll = jax.jit(lambda x, t: model.token_losses(x, t))(inputs, targets)
  return [-float(v) for v in np.sum(np.asarray(nll, np.float64), axis=1)]


def _continuation_row(tok, context, continuation, L):
  """lm-eval's hf model: BOS + context + continuation encoded together, the continuation
  the tokens past the context's encoding, cut from the left to L + 1 tokens."""
  whole, ctx = tok.encode(context + continuation), tok.encode(context)
  n = len(whole) - len(ctx)
  seq = whole[-(L + 1):]
  return seq[:-1], [-1] * (len(seq) - 1 - n) + seq[-n:]


def _rolling_rows(tok, text, L):
  """Disjoint windows of L predictions; each sees up to L tokens before its last one."""
  seq = [tok.bos_id] + tok.encode(text, bos=False)
  rows = []
  for first in range(0, len(seq) - 1, L):
    end = min(first + L, len(seq) - 1)
    lo = max(0, end - L)
    inputs, targets = seq[lo:end], seq[lo + 1:end + 1]
    rows.append((inputs, [t if lo + 1 + i > first else -1 for i, t in enumerate(targets)]))
  return rows


CONTINUATIONS = [("The sun rises in the", " east"), ("Question: what is 2+2?\nAnswer:", " 4"),
                 ("", "An empty context scores after <|bos|>."),
                 ("Trailing space ", "moves to the continuation"),
                 (" ".join(["a long context"] * 40), " past the window")]  # cut from the left
TEXTS = ["One short sentence.", " ".join(f"word{i}" for i in range(80))]  # 1 and 3+ windows


def test_loglikelihoods_are_the_models_own_token_losses(run, lm):
  wd, model = run
  tok = lm.tok
  got = lm.loglikelihood([_request("loglikelihood", a) for a in CONTINUATIONS])
  ctx = [c.rstrip() if c else c for c, _ in CONTINUATIONS]
  cont = [c[len(x):] + k for (c, k), x in zip(CONTINUATIONS, ctx)]
  rows = [_continuation_row(tok, x, k, CONTEXT) if x else
          ([tok.bos_id] + tok.encode(k, bos=False)[:-1], tok.encode(k, bos=False))
          for x, k in zip(ctx, cont)]
  assert len(rows[-1][0]) == CONTEXT  # the long one was cut
  np.testing.assert_allclose([g[0] for g in got], _own_loglikelihood(model, rows),
                             rtol=0, atol=1e-5)
  rolling = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (t,)) for t in TEXTS])
  assert len(_rolling_rows(tok, TEXTS[1], CONTEXT)) >= 3
  windows = [_rolling_rows(tok, t, CONTEXT) for t in TEXTS]
  own = iter(_own_loglikelihood(model, [w for ws in windows for w in ws]))
  want = [sum(next(own) for _ in ws) for ws in windows]
  # a whole text sums thousands of nats: its fp32 rounding is relative (1e-6 of the sum)
  np.testing.assert_allclose(rolling, want, rtol=1e-6, atol=1e-5)
  assert len(lm.scorer.shapes) <= 4  # bucketed: a few shapes, not one per request


def test_is_greedy_when_the_continuation_is_the_argmax(lm):
  """A continuation made of the model's own greedy tokens is greedy; one token changed,
  it is not."""
  context = "The sun rises in the"
  ids = inference.generate_cached(lm.graphdef, lm.params, lm.tok.encode(context), 3,
                                  CONTEXT)
  # decode the tokens as ids, not text: a text round trip may encode differently
  ((_, own),) = lm._loglikelihood_tokens([(None, lm.tok.encode(context), ids)])
  changed = ids[:-1] + [(ids[-1] + 1) % 250]
  ((_, other),) = lm._loglikelihood_tokens([(None, lm.tok.encode(context), changed)])
  assert own and not other


@pytest.mark.slow  # compile-heavy: decoding programs of several batch shapes
def test_generate_until_is_greedy_sampling(run, lm, monkeypatch):
  """generate_until, batched over prompts of different lengths, gives --mode=sample's
  greedy tokens for each prompt; a stop string cuts the text and ends decoding early."""
  wd, _ = run
  prompts = ["def f", "The sun rises in the east and", "x"]
  n = 12
  want = []
  for p in prompts:
    cfg = rundir.read_config(wd)
    cfg.sample.update(prompt=p, max_new_tokens=n, temperature=0.0)
    ids = modes.sample(spec_lib.resolve(cfg), wd)["tokens"]
    ids = ids[:ids.index(lm.tok.bos_id)] if lm.tok.bos_id in ids else ids
    want.append(lm.tok.decode(ids))
  got = lm.generate_until([_request("generate_until", (p, {"until": [], "max_gen_toks": n}))
                           for p in prompts])
  assert got == want
  assert lm.prompt_shapes == {(4, CONTEXT)}  # three prompt lengths, one padded shape
  # a stop string the first generation reaches after a few tokens
  stop = want[0][len(want[0]) // 3:len(want[0]) // 3 + 2]
  chunks = []
  real_stream = inference.stream

  def counted(*a, **k):
    for c in real_stream(*a, **k):
      chunks.append(c)
      yield c
  monkeypatch.setattr(inference, "stream", counted)
  (text,) = lm.generate_until([_request("generate_until", (prompts[0], {"until": [stop],
                                                                         "max_gen_toks": n}))])
  assert text == want[0].split(stop, 1)[0]
  assert len(chunks) < n // lm.decode_chunk  # stopped between chunks, before the budget
  greedy = {"until": [stop, ""], "max_gen_toks": n, "top_p": 0.9}  # top_p: sampling only
  assert lm.generate_until([_request("generate_until", (prompts[0], greedy))]) == [text]
  with pytest.raises(ValueError, match=r"\[.top_p.\] are not supported"):
    lm.generate_until([_request("generate_until", ("x", {"do_sample": True, "top_p": 0.9}))])
  with pytest.raises(ValueError, match=r"\[.num_beams.\] are not supported"):
    lm.generate_until([_request("generate_until", ("x", {"num_beams": 4}))])
  with pytest.raises(ValueError, match="max_gen_toks=64"):
    lm.generate_until([_request("generate_until", ("x", {"max_gen_toks": CONTEXT}))])


def test_an_exported_folder_scores_as_its_run(run, lm, tmp_path):
  from bov_jax.interop import export
  wd, _ = run
  export.export(wd, str(tmp_path / "hf"))
  folder = lm_eval.BovLM(str(tmp_path / "hf"), batch_size=8)
  requests = [_request("loglikelihood", a) for a in CONTINUATIONS[:2]]
  assert folder.loglikelihood(requests) == lm.loglikelihood(requests)


def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
  with pytest.raises(ValueError, match="holds no config.json or run_config.json"):
    lm_eval.BovLM(str(tmp_path))


@pytest.mark.slow
def test_the_command_runs_local_tasks_offline(run, tmp_path):
  """lm-eval's own evaluator on the three local tasks (multiple choice, generation,
  perplexity), no network: FILE holds lm-eval's results, stdout one summary line."""
  wd, _ = run
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
             HF_HOME=str(tmp_path / "hf_home"))
  out = command("lm_eval", f"--workdir={wd}",
                "--tasks=bov_tiny_mc,bov_tiny_gen,bov_tiny_ppl", f"--include_path={TASKS}",
                "--limit=20", f"--output={tmp_path / 'res.json'}", "--batch_size=8", env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  results = json.loads((tmp_path / "res.json").read_text())
  acc = results["results"]["bov_tiny_mc"]["acc,none"]
  assert 0.0 <= acc <= 1.0 and summary["results"]["bov_tiny_mc"]["acc,none"] == acc
  assert results["n-samples"]["bov_tiny_mc"]["effective"] == 20
  assert "exact_match,none" in results["results"]["bov_tiny_gen"]
  assert results["results"]["bov_tiny_ppl"]["bits_per_byte,none"] > 0
  assert summary["step"] == 7 and results["bov_jax"]["step"] == 7


def test_the_processes_share_the_requests_in_turn(lm, monkeypatch):
  """Process p of P runs every P-th request from p; each gets all the answers, in order."""
  items = list(range(7))
  monkeypatch.setattr(jax, "process_count", lambda: 3)

  def allgather(share):  # this process's answers, and the others' by the same rule
    assert share == [10 * i for i in items[jax.process_index()::3]]
    return [[10 * i for i in items[q::3]] for q in range(3)]
  monkeypatch.setattr(lm_eval.process, "allgather", allgather)
  for p, mine in enumerate([[0, 3, 6], [1, 4], [2, 5]]):
    monkeypatch.setattr(jax, "process_index", lambda p=p: p)
    seen = []
    out = lm._shared(lambda share: seen.extend(share) or [10 * i for i in share], items)
    assert out == [0, 10, 20, 30, 40, 50, 60] and seen == mine


@pytest.mark.slow  # three lm-eval commands
def test_two_processes_give_one_process_results_and_process_0_writes(run, tmp_path):
  """The command started on both processes of a two-process run (gloo, a coordinator on
  this host) against one process on the same exported folder: the same accuracies and
  answers (log-likelihoods within 1e-5: batches of other rows); FILE and the summary line
  come from process 0 alone."""
  from bov_jax.interop import export
  folder = str(tmp_path / "hf")
  export.export(run[0], folder)
  args = [f"--workdir={folder}", "--tasks=bov_tiny_mc,bov_tiny_gen,bov_tiny_ppl",
          f"--include_path={TASKS}", "--batch_size=8", "--log_samples"]
  offline = {"HF_HUB_OFFLINE": 1, "HF_DATASETS_OFFLINE": 1, "HF_HOME": tmp_path / "hf_home"}
  port = free_port()
  two = [start("lm_eval", *args, f"--output={tmp_path / 'two.json'}",
               f"--coordinator_address=localhost:{port}", "--num_processes=2",
               env=command_env(1, JAX_PROCESS_ID=i, **offline), stderr=subprocess.PIPE)
         for i in range(2)]
  one = command("lm_eval", *args, f"--output={tmp_path / 'one.json'}",
                env=command_env(1, **offline))
  outs = [p.communicate(timeout=600) for p in two]
  assert one.returncode == 0, one.stderr[-3000:]
  assert [p.returncode for p in two] == [0, 0], [e[-3000:] for _, e in outs]
  lines = [[x for x in out.splitlines() if not x.startswith("[Gloo]")] for out, _ in outs]
  assert len(lines[0]) == 1 and json.loads(lines[0][0])["step"] == 7 and lines[1] == []
  got, want = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
  for task, metrics in want["results"].items():
    for m, v in metrics.items():
      if isinstance(v, float) and "bits" not in m and "perplexity" not in m:
        assert got["results"][task][m] == v, (task, m)
      elif isinstance(v, float):
        assert got["results"][task][m] == pytest.approx(v, rel=1e-6), (task, m)
  for task, samples in want["samples"].items():
    mine = {s["doc_id"]: s["resps"] for s in got["samples"][task]}
    assert sorted(mine) == sorted(s["doc_id"] for s in samples)
    for s in samples:
      for (a,), (b,) in zip(s["resps"], mine[s["doc_id"]], strict=True):
        if isinstance(a, str):
          assert a == b
        else:
          a, b = (a, b) if isinstance(a, list) else ([a], [b])
          assert a[0] == pytest.approx(b[0], abs=1e-5) and a[1:] == b[1:]


def test_unknown_tasks_are_refused_by_name():
  from lm_eval.tasks import TaskManager
  manager = TaskManager(include_path=TASKS, include_defaults=False)  # the local tasks only
  lm_eval.check_tasks(manager, ["bov_tiny_mc", "bov_tiny_ppl"])
  with pytest.raises(ValueError, match=r"--tasks: unknown task\(s\) \['no_such_task'\]"):
    lm_eval.check_tasks(manager, ["bov_tiny_mc", "no_such_task"])
  with pytest.raises(ValueError, match="--tasks"):
    lm_eval.check_tasks(manager, [])


def test_the_local_tasks_alone_are_indexed_when_they_are_all_asked_for(monkeypatch):
  """lm-eval's own tasks are indexed (about 20 s) only when a task asked for is not one of
  --include_path's."""
  local = lm_eval.task_manager(TASKS, ["bov_tiny_mc", "bov_tiny_gen"])
  assert "bov_tiny_mc" in local.all_subtasks and "hellaswag" not in local.all_tasks
  import lm_eval.tasks as lm_eval_tasks
  made = []

  class Recorder(lm_eval_tasks.TaskManager):  # lm-eval's own tasks, left unread
    def __init__(self, include_path=None, include_defaults=True):
      made.append(include_defaults)
      super().__init__(include_path=include_path, include_defaults=False)
  monkeypatch.setattr(lm_eval_tasks, "TaskManager", Recorder)
  lm_eval.task_manager(TASKS, ["bov_tiny_mc", "hellaswag"])
  lm_eval.task_manager(None, ["bov_tiny_mc"])
  assert made == [False, True, True]
