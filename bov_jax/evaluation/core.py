"""CORE (the DCLM tasks, as the reference's core_eval.py scores them) on an eval bundle.

The task list is the authors' (core_tasks.yaml beside this module, their repository's
configs/core.yaml: 21 tasks), not the bundle's own core.yaml, unless eval.core_config
names another file of the same form:
  icl_tasks: [{label, dataset_uri, num_fewshot: [k], icl_task_type, continuation_delimiter?}]
Bundle layout:
  DIR/eval_meta_data.csv      columns "Eval Task", "Random baseline" (percent)
  DIR/eval_data/<dataset_uri> JSONL items:
      multiple_choice    {query, choices, gold}
      schema             {context_options, continuation, gold}
      language_modeling  {context, continuation}

Prompts follow the reference: few-shot examples (drawn per item with a fixed
seed, never the item itself) joined by blank lines, BOS in front. Multiple
choice: the shared token prefix is the context; the choice with the lowest
summed NLL per UTF-8 byte wins. Schema: the shared suffix is the continuation,
same rule over contexts. LM: correct iff greedy decoding reproduces every
continuation token. Prompts are never cut: a prompt longer than model.sequence_len
runs whole, at positions past it, as the reference runs it (its rotary table covers
ten times the training length, and nothing truncates). Scoring (`Scorer`) is one jitted
function over [rows, length] buckets, so it compiles once per bucket, not per item.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from bov_jax.host import process
from bov_jax.kernels.sampling import greedy

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234


class BundleError(ValueError):
  pass


@dataclasses.dataclass
class Task:
  label: str
  dataset_uri: str
  num_fewshot: int
  task_type: str
  delimiter: str = " "
  random_baseline: float = 0.0  # percent


# -- the bundle ------------------------------------------------------------------

AUTHORS_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core_tasks.yaml")


def load_bundle(bundle: str, core_config: str = "") -> list[Task]:
  """The tasks of `core_config` (default: the authors' 21) with the bundle's random
  baselines; every task's data file is checked here, before anything is scored."""
  import yaml
  yaml_path = epath.Path(core_config or AUTHORS_TASKS)
  meta_path = epath.Path(bundle) / "eval_meta_data.csv"
  if not yaml_path.exists():
    raise BundleError(f"eval.core_config={core_config}: no such file")
  if not meta_path.exists():
    raise BundleError(f"eval.core_bundle={bundle}: missing {meta_path.name}")
  spec = yaml.safe_load(yaml_path.read_text()) or {}
  if "icl_tasks" not in spec:
    raise BundleError(f"{yaml_path}: expected a top-level 'icl_tasks' list")
  baselines = {}
  for row in csv.DictReader(io.StringIO(meta_path.read_text(), newline="")):
    if "Eval Task" not in row or "Random baseline" not in row:
      raise BundleError(f"{meta_path}: expected columns 'Eval Task' and 'Random baseline'")
    baselines[row["Eval Task"]] = float(row["Random baseline"])
  tasks = []
  for t in spec["icl_tasks"]:
    kind = t.get("icl_task_type")
    if kind not in TASK_TYPES:
      raise BundleError(f"{yaml_path}: task {t.get('label')!r} has icl_task_type={kind!r}; "
                        f"expected one of {', '.join(TASK_TYPES)}")
    shots = t.get("num_fewshot", [0])
    shots = shots if isinstance(shots, list) else [shots]
    if t["label"] not in baselines:
      raise BundleError(f"{meta_path} has no 'Random baseline' for task {t['label']!r}")
    for k in shots:
      label = t["label"] if len(shots) == 1 else f"{t['label']}_{k}shot"
      tasks.append(Task(label=label, dataset_uri=t["dataset_uri"], num_fewshot=int(k),
                        task_type=kind, delimiter=t.get("continuation_delimiter", " "),
                        random_baseline=baselines[t["label"]]))
  for task in tasks:
    path = epath.Path(bundle) / "eval_data" / task.dataset_uri
    if not path.exists():
      raise BundleError(f"eval.core_bundle={bundle}: task {task.label!r} needs {path}, "
                        "which is missing")
  return tasks


def load_items(bundle: str, task: Task, max_per_task: int = -1) -> list[dict]:
  path = epath.Path(bundle) / "eval_data" / task.dataset_uri
  if not path.exists():
    raise BundleError(f"task {task.label!r}: missing {path}")
  items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  random.Random(SHUFFLE_SEED).shuffle(items)
  return items[:max_per_task] if max_per_task and max_per_task > 0 else items


# -- prompts -----------------------------------------------------------------------

def fewshot_examples(items: list[dict], idx: int, k: int) -> list[dict]:
  if k <= 0:
    return []
  rng = random.Random(FEWSHOT_SEED + idx)
  others = [i for i in range(len(items)) if i != idx]
  return [items[i] for i in rng.sample(others, min(k, len(others)))]


def render(task: Task, item: dict, shots: list[dict]) -> list[str]:
  """The prompt texts for one item (one per choice; [without, with] for LM)."""
  d = task.delimiter
  if task.task_type == "multiple_choice":
    head = "".join(f"{e['query']}{d}{e['choices'][e['gold']]}\n\n" for e in shots)
    return [f"{head}{item['query']}{d}{c}" for c in item["choices"]]
  if task.task_type == "schema":
    head = "".join(f"{e['context_options'][e['gold']]}{d}{e['continuation']}\n\n" for e in shots)
    return [f"{head}{c}{d}{item['continuation']}" for c in item["context_options"]]
  head = "".join(f"{e['context'].strip()}{d}{e['continuation']}\n\n" for e in shots)
  without = f"{head}{item['context'].strip()}{d}"
  return [without.strip(), without + item["continuation"]]


def common_length(seqs: list[list[int]], direction: str) -> int:
  """Length of the shared prefix ('left') or suffix ('right') of token lists."""
  n = min(len(s) for s in seqs)
  for i in range(n):
    j = i if direction == "left" else -(i + 1)
    if any(s[j] != seqs[0][j] for s in seqs):
      return i
  return n


@dataclasses.dataclass
class Scored:
  tokens: list[list[int]]
  starts: list[int]   # first continuation token of each row
  ends: list[int]     # one past the last


def spans(task: Task, prompts: list[str], tok) -> Scored:
  rows = [tok.encode(p) for p in prompts]  # BOS in front
  if task.task_type == "multiple_choice":
    start = common_length(rows, "left")
    return Scored(rows, [start] * len(rows), [len(r) for r in rows])
  if task.task_type == "schema":
    suffix = common_length(rows, "right")
    return Scored(rows, [len(r) - suffix for r in rows], [len(r) for r in rows])
  without, with_ = rows
  if with_[:len(without)] != without:
    # the tokenizer merged across the boundary: score the tokens after the shared prefix
    start = common_length([without, with_], "left")
  else:
    start = len(without)
  return Scored([with_], [start], [len(with_)])


# -- scoring -------------------------------------------------------------------------

def bucket(n: int) -> int:
  """A length padded to a power of two (at least 64), so few shapes compile."""
  b = 64
  while b < n:
    b *= 2
  return b


def padded_shape(n_rows: int, length: int, most: int | None = None) -> tuple[int, int]:
  """A batch's compiled shape: rows padded to a multiple of 4, positions to a `bucket`
  (at most `most`)."""
  return -(-n_rows // 4) * 4, min(bucket(length), most or bucket(length))


class Scorer:
  """Per-token NLL and greedy next tokens of token rows. Rows run in batches of up to
  `batch_rows`, longest first, each padded to a multiple of 4 rows and a `bucket` of
  positions: one compile per (rows, positions) shape in `shapes`, not per row. CORE and
  the lm-eval adapter (lm_eval.py) both score through it."""

  def __init__(self, graphdef, params, pad_id: int, batch_rows: int = 32):
    self.params, self.pad_id, self.batch_rows = params, pad_id, batch_rows
    self.shapes = set()

    @jax.jit
    def score(params, ids, targets):
      model = nnx.merge(graphdef, params)
      logits = model(ids)  # [N, L, V] fp32
      logz = jax.nn.logsumexp(logits, axis=-1)
      nll = logz - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
      return nll, greedy(logits, model.spec.sampler)

    self.score = score

  def __call__(self, rows: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each row r, (nll, pred), both of len(r) - 1: nll[j] = -log p(r[j+1] | r[:j+1])
    and pred[j] the greedy token after r[:j+1] (position j predicts token j + 1)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out = [None] * len(rows)
    for k in range(0, len(order), self.batch_rows):
      batch = order[k:k + self.batch_rows]
      shape = padded_shape(len(batch), len(rows[batch[0]]) - 1)
      self.shapes.add(shape)
      ids = np.full(shape, self.pad_id, np.int32)
      targets = np.full(shape, self.pad_id, np.int32)
      for j, i in enumerate(batch):
        r = rows[i]
        ids[j, :len(r) - 1], targets[j, :len(r) - 1] = r[:-1], r[1:]
      nll, pred = (np.asarray(x) for x in self.score(self.params, ids, targets))
      for j, i in enumerate(batch):
        out[i] = (nll[j, :len(rows[i]) - 1], pred[j, :len(rows[i]) - 1])
    return out


def score_item(task: Task, s: Scored, scorer: Scorer, tok, gold) -> bool:
  scored = scorer(s.tokens)
  if task.task_type == "language_modeling":
    a, b = s.starts[0], s.ends[0]
    return bool(np.all(scored[0][1][a - 1:b - 1] == np.asarray(s.tokens[0][a:b])))
  scores = []
  for (nll, _), t, a, b in zip(scored, s.tokens, s.starts, s.ends):
    n_bytes = max(1, len(tok.decode(t[a:b]).encode("utf-8")))
    scores.append(float(np.sum(nll[a - 1:b - 1])) / n_bytes)
  return int(np.argmin(scores)) == int(gold)


def centered(acc: float, random_baseline_pct: float) -> float:
  r = 0.01 * random_baseline_pct
  return (acc - r) / (1.0 - r)


def evaluate_task(bundle, task: Task, scorer: Scorer, tok, max_per_task: int = -1) -> float:
  items = load_items(bundle, task, max_per_task)
  correct = 0
  for idx, item in enumerate(items):
    prompts = render(task, item, fewshot_examples(items, idx, task.num_fewshot))
    correct += score_item(task, spans(task, prompts, tok), scorer, tok, item.get("gold"))
  return correct / max(1, len(items))


def core(bundle: str, graphdef, params, tok, max_per_task: int = -1, core_config: str = "",
         log=print) -> dict:
  """{'core': mean centered accuracy,
      'core_tasks': {label: {'shots': n, 'accuracy': a, 'centered': c}}}."""
  tasks = load_bundle(bundle, core_config)
  scorer = Scorer(graphdef, params, pad_id=tok.bos_id)
  results = {}
  for task in tasks:
    acc = evaluate_task(bundle, task, scorer, tok, max_per_task)
    results[task.label] = {"shots": task.num_fewshot, "accuracy": acc,
                           "centered": centered(acc, task.random_baseline)}
    log(f"CORE {task.label} ({task.num_fewshot}-shot): accuracy {acc:.4f}, "
        f"centered {results[task.label]['centered']:.4f}")
  score = float(np.mean([r["centered"] for r in results.values()])) if results else float("nan")
  return {"core": score, "core_tasks": results}


def run(spec, graphdef, params, tok) -> dict:
  """CORE of a run's model with its eval.core_* settings (the loop's and --mode=eval's)."""
  return core(spec.eval.core_bundle, graphdef, params, tok, spec.eval.core_max_per_task,
              spec.eval.core_config, log=process.log)
