"""EleutherAI's lm-evaluation-harness on a run directory or an exported folder (the
command `python -m bov_jax.lm_eval`).

`BovLM` is lm-eval's `LM` over the run's newest checkpoint (or the folder's weights),
computing what lm-eval's own `hf` model computes:
  loglikelihood          the continuation's summed log-probability and whether greedy
                         decoding gives it; context and continuation encoded together,
                         <|bos|> in front (the model's training documents start with it),
                         cut from the left to model.sequence_len + 1 tokens
  loglikelihood_rolling  a text's log-probability in lm-eval's disjoint rolling windows
                         of model.sequence_len tokens, the first after <|bos|>
  generate_until         `inference.stream` over the cache, the context cut from the left
                         to leave max_gen_toks; stop strings (and <|bos|>, the end of a
                         document) checked between chunks of decode steps; the text
                         decoded without special tokens
Rows are scored by core.Scorer, CORE's batching (longest first, bucketed shapes), and
prompts padded to the same buckets, so nothing recompiles per request. The model is placed
on this host's devices by the run's mesh settings. Started on every process of a
multi-process run, each process holds a whole copy of the model and takes every P-th
request (lm-eval builds the same requests in each); the answers are gathered to every
process, so each computes the same metrics, and process 0 alone writes FILE.

FILE (default DIR/lm_eval.json) is the JSON lm-eval's evaluator returns
(`results.<task>.acc,none`, ...), with the run's step; stdout gets one summary line. Tasks
whose data is local run offline (HF_HUB_OFFLINE=1): a task YAML under --include_path
whose `dataset_path: json` names local files, as tests/data/lm_eval/ does.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from bov_jax.data import sources
from bov_jax.evaluation import core
from bov_jax.host import extras
from bov_jax.host import process
from bov_jax.inference import generate as inference
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.run import spec as spec_lib
from bov_jax.store import rundir

try:
  from lm_eval import utils as lm_utils
  from lm_eval.api.model import TemplateLM
except ImportError:  # the eval extra is not installed: the command says so (extras.py)
  lm_utils, TemplateLM = None, object

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k")
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p")  # ignored when decoding greedily


class BovLM(TemplateLM):
  """lm-eval's model interface over a bov_jax run directory or exported folder."""

  def __init__(self, workdir: str, batch_size: int = 32, max_gen_toks: int = 256,
               decode_chunk: int = 32, seed: int = 0):
    extras.require("lm_eval", "eval", "bov_jax.lm_eval")
    super().__init__()
    cfg = rundir.config_of(workdir)
    if batch_size < 1 or max_gen_toks < 1 or decode_chunk < 1:
      raise ValueError(f"--batch_size={batch_size}, --max_gen_toks={max_gen_toks} and the "
                       f"decode chunk {decode_chunk} must be positive")
    # this host's devices: the processes score different requests, so none waits on another
    spec = spec_lib.resolve(cfg, n_devices=jax.local_device_count())
    self.spec, self.workdir = spec, workdir
    self.mesh = sharding.make_mesh(spec.mesh, jax.local_devices())
    self.tok = sources.tokenizer(spec, workdir)
    with jax.set_mesh(self.mesh):
      self.step, self.graphdef, self.params = params_lib.restore(spec, workdir, self.mesh)
    self.scorer = core.Scorer(self.graphdef, self.params, pad_id=self.tok.bos_id,
                              batch_rows=batch_size)
    self.batch_size, self._max_gen_toks = batch_size, max_gen_toks
    self.decode_chunk, self.seed = decode_chunk, seed
    self.prompt_shapes = set()  # (rows, positions) of every generation batch

  # -- what lm-eval asks of a model -----------------------------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.tok.bos_id  # nanochat's documents are separated by <|bos|>, not an EOS

  @property
  def max_length(self) -> int:
    return self.spec.model.sequence_len

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def tokenizer_name(self) -> str:
    return "bov_jax"

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
    return self.tok.encode(string, bos=add_special_tokens is not False)

  def tok_decode(self, tokens, **kwargs) -> str:
    return self.tok.decode(tokens)

  def _decode(self, tokens) -> str:
    """Generated text without special tokens, as lm-eval's hf model decodes it."""
    return self.tok.decode(tokens, special=False)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    """[(request, context ids, continuation ids)] -> [(log-probability, is greedy)]."""
    rows, conts = [], []
    for _, context, continuation in requests:
      if not context or not continuation or len(continuation) > self.max_length:
        raise ValueError(f"a request of {len(context)} context and {len(continuation)} "
                         f"continuation tokens (need both, continuation <= {self.max_length})")
      rows.append((context + continuation)[-(self.max_length + 1):])
      conts.append(len(continuation))
    out = self._shared(self._score, list(zip(rows, conts)))
    for (request, _, _), answer in zip(requests, out):
      if request is not None:
        self.cache_hook.add_partial("loglikelihood", request, answer)
    return out

  def _score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """[(row, continuation length)] -> [(log-probability, is greedy)], on this process."""
    with jax.set_mesh(self.mesh):
      scored = self.scorer([row for row, _ in rows])
    return [(-float(np.sum(nll[-n:], dtype=np.float64)),
             bool(np.all(pred[-n:] == np.asarray(row[-n:]))))
            for (row, n), (nll, pred) in zip(rows, scored)]

  def _shared(self, fn, items: list) -> list:
    """fn(items) with the work shared by the processes: each runs fn on every P-th item
    from its own index; every process gets all the answers, in items' order."""
    n = jax.process_count()
    shares = process.allgather(fn(items[jax.process_index()::n]) if items else [])
    out = [None] * len(items)
    for p, share in enumerate(shares):
      out[p::n] = share
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for i, (text,) in enumerate(r.args for r in requests):
      for context, pred in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text, add_special_tokens=False),
          prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
        windows.append((None, context, pred))
        owner.append(i)
    totals = [0.0] * len(requests)
    for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
      totals[i] += ll
    for r, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or, with do_sample, sampled) continuations."""
    out = self._shared(self._generate_all, [r.args for r in requests])
    for args, text in zip((r.args for r in requests), out):
      self.cache_hook.add_partial("generate_until", args, text)
    return out

  def _generate_all(self, requests: list[tuple[str, dict]]) -> list[str]:
    """[(context, generation settings)] -> texts, on this process, batched per
    generation setting, longest prompts first."""
    groups = {}
    for i, (_, kwargs) in enumerate(requests):
      groups.setdefault(json.dumps(kwargs or {}, sort_keys=True, default=str), []).append(i)
    out = [None] * len(requests)
    for key, members in groups.items():
      settings = self._generation_settings(json.loads(key))
      prompts = {i: self._prompt(requests[i][0], settings["max_gen_toks"]) for i in members}
      members.sort(key=lambda i: -len(prompts[i]))
      for k in range(0, len(members), self.batch_size):
        batch = members[k:k + self.batch_size]
        for i, text in zip(batch, self._generate([prompts[i] for i in batch], **settings)):
          out[i] = text
    return out

  # -- generation -----------------------------------------------------------------------

  def _generation_settings(self, kwargs: dict) -> dict:
    unknown = set(kwargs) - set(GEN_KWARGS)
    if not kwargs.get("do_sample"):  # greedy: what only shapes sampling does not matter
      unknown -= set(SAMPLING_ONLY)
    unknown = sorted(unknown)
    if unknown:
      raise ValueError(f"generation settings {unknown} are not supported by bov_jax.lm_eval "
                       f"(supported: {', '.join(GEN_KWARGS)})")
    until = kwargs.get("until") or []
    until = [s for s in ([until] if isinstance(until, str) else until) if s]
    n = int(kwargs.get("max_gen_toks", self.max_gen_toks))
    if not 0 < n < self.max_length:
      raise ValueError(f"max_gen_toks={n}: expected 1 to {self.max_length - 1} "
                       f"(model.sequence_len={self.max_length})")
    temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
    return {"until": until, "max_gen_toks": n, "temperature": temperature,
            "top_k": int(kwargs.get("top_k") or 0)}

  def _prompt(self, context: str, max_gen_toks: int) -> list[int]:
    """<|bos|> and the context, cut from the left to leave room for max_gen_toks."""
    return self.tok_encode(context)[-(self.max_length - max_gen_toks):]

  def _generate(self, prompts: list[list[int]], until: list[str], max_gen_toks: int,
                temperature: float, top_k: int) -> list[str]:
    shape = core.padded_shape(len(prompts), max(map(len, prompts)), self.max_length)
    self.prompt_shapes.add(shape)
    ids = np.full(shape, self.tok.bos_id, np.int32)
    lengths = np.ones(shape[0], np.int32)  # padding rows: a lone <|bos|>
    for j, p in enumerate(prompts):
      ids[j, :len(p)], lengths[j] = p, len(p)
    new = [[] for _ in prompts]
    with jax.set_mesh(self.mesh):
      for chunk in inference.stream(
          self.graphdef, self.params, jnp.asarray(ids), jnp.asarray(lengths),
          jax.random.key(self.seed), context=self.max_length, max_new_tokens=max_gen_toks,
          chunk=self.decode_chunk, temperature=temperature, top_k=top_k):
        for j in range(len(prompts)):
          new[j].extend(int(t) for t in chunk[j])
        if all(self._stopped(t, until) for t in new):
          break
    return [self._text(t, until) for t in new]

  def _stopped(self, tokens: list[int], until: list[str]) -> bool:
    return self.tok.bos_id in tokens or any(s in self._decode(tokens) for s in until)

  def _text(self, tokens: list[int], until: list[str]) -> str:
    """The generated text up to <|bos|> and the first stop string (neither included)."""
    if self.tok.bos_id in tokens:
      tokens = tokens[:tokens.index(self.tok.bos_id)]
    text = self._decode(tokens)
    for s in until:
      text = text.split(s, 1)[0]
    return text


# -- an evaluation of tasks ----------------------------------------------------------------

def summary(results: dict) -> dict:
  """{task: {metric: value}} of lm-eval's results, numbers only."""
  return {task: {k: v for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
          for task, metrics in results.get("results", {}).items()}


def task_manager(include_path: str | None, tasks: list[str]):
  """lm-eval's task manager of --include_path's tasks alone where those are every task
  asked for (indexing lm-eval's own few thousand task files takes about 20 s), else of
  both."""
  from lm_eval.tasks import TaskManager
  if include_path:
    local = TaskManager(include_path=include_path, include_defaults=False)
    if tasks and set(tasks) <= set(local.all_subtasks):
      return local
  return TaskManager(include_path=include_path)


def check_tasks(manager, tasks: list[str]) -> None:
  """ValueError naming the tasks lm-eval's task manager does not know."""
  unknown = [t for t in tasks if not manager.match_tasks([t])]
  if not tasks or unknown:
    raise ValueError(f"--tasks: unknown task(s) {unknown} (lm-eval's task names, or a task "
                     "YAML under --include_path)" if tasks else "--tasks=NAME[,NAME] is required")


def evaluate(workdir: str, tasks: list[str], num_fewshot: int | None = None,
             limit: float | None = None, include_path: str | None = None,
             output: str | None = None, batch_size: int = 32, max_gen_toks: int = 256,
             seed: int = 0, log_samples: bool = False, log=print) -> dict:
  """Runs lm-eval's evaluator on the tasks; writes FILE (with log_samples, lm-eval's
  `samples`: every request's arguments and the model's responses); returns the summary
  record."""
  extras.require("lm_eval", "eval", "bov_jax.lm_eval")
  from etils import epath
  from lm_eval import evaluator

  rundir.config_of(workdir)  # a wrong --workdir fails before lm-eval indexes its tasks
  manager = task_manager(include_path, tasks)
  check_tasks(manager, tasks)
  lm = BovLM(workdir, batch_size=batch_size, max_gen_toks=max_gen_toks, seed=seed)
  results = evaluator.simple_evaluate(
      model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
      log_samples=log_samples, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
      fewshot_random_seed=seed)
  results["bov_jax"] = {"workdir": workdir, "step": int(lm.step)}
  path = epath.Path(output) if output else rundir.path(workdir) / rundir.LM_EVAL
  if process.is_main():  # every process has the same results
    path.write_text(json.dumps(results, indent=2, default=lm_utils.handle_non_serializable))
    log(lm_utils.make_table(results))
  return {"step": int(lm.step), "output": str(path), "results": summary(results)}
