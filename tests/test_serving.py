"""Serving: the paged engine's tokens against --mode=sample's whatever else is in flight,
its page bookkeeping, and the server as users call it (the official openai client,
streaming and not, errors, overload, a client that leaves, SIGTERM, a load test)."""
import concurrent.futures
import json
import re
import signal
import threading
import time
import urllib.request

import jax
import numpy as np
import pytest

from bov_jax.data import sources
from bov_jax.inference import generate as inference
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.run import spec as spec_lib
from bov_jax.serving import engine as engine_lib
from bov_jax.serving import load
from bov_jax.serving import pages as pages_lib
from bov_jax.store import rundir
from tests.helpers import start

openai = pytest.importorskip("openai", reason="the tests call the server with the openai "
                             "client (the dev extra)")

PROMPTS = ["def ", "import os\n", "class Tree:\n    def", "x = [", "for i in range(", "# a"]


def test_page_pool_takes_and_returns_pages():
  pool = pages_lib.PagePool(num_pages=6, page_size=4, slots=2, max_pages=3)
  assert pool.grow(0, 5) and list(pool.table[0]) == [1, 2, 0] and pool.used == 2
  assert pool.grow(1, 12) and list(pool.table[1]) == [3, 4, 5]
  assert not pool.grow(0, 9) and pool.held[0] == 2  # no free page: nothing taken
  pool.release(1)
  assert pool.used == 2 and list(pool.table[1]) == [0, 0, 0]
  assert pool.grow(0, 9) and pool.held[0] == 3 and 0 not in pool.table[0]


def _generate(engine, prompts, max_tokens, **sampling):
  """Every prompt through the engine at once: [(tokens, finish_reason)]."""
  done, events = {}, threading.Event()

  def request(i, ids, n):
    def on_event(kind, payload):
      if kind == "done":
        done[i] = payload
        if len(done) == len(prompts):
          events.set()
    return engine_lib.Request(prompt=ids, max_tokens=n, on_event=on_event, **sampling)

  jobs = [request(i, ids, n) for i, (ids, n) in enumerate(zip(prompts, max_tokens))]
  for job in jobs:
    engine.submit(job)
  assert events.wait(120)
  return [(job.generated, done[i]["finish_reason"]) for i, job in enumerate(jobs)]


def _sample_tokens(workdir, ids, n):
  """--mode=sample's greedy tokens (inference.generate_cached) for one prompt."""
  spec = spec_lib.resolve(rundir.config_of(workdir), n_devices=1)
  mesh = sharding.make_mesh(spec.mesh, jax.devices()[:1])
  with jax.set_mesh(mesh):
    _, graphdef, params = params_lib.restore(spec, workdir, mesh)
  return inference.generate_cached(graphdef, params, ids, n, spec.model.sequence_len)


@pytest.mark.parametrize("budget_pages, decode_steps, apart",
                         [(None, 8, False), (9, 8, False), (None, 1, False), (9, 3, True)])
def test_greedy_tokens_do_not_depend_on_what_else_is_in_flight(tiny_run, budget_pages,
                                                               decode_steps, apart,
                                                               monkeypatch):
  """Six prompts of different lengths decoded together in four slots (float32), equal
  to --mode=sample's tokens for each alone; the first four are prefilled in one call.
  With a budget of 8 pages (9 with the one no sequence holds) the sequences outgrow the
  cache and the newest are sent back to the queue and prefilled again: the same tokens.
  A decode call of several steps ends most sequences between its steps: what it draws
  past their ends is dropped. Decoded in two calls a step (the shortest sequence apart
  from the others, as `Engine._groups` splits them): the same tokens."""
  if apart:
    monkeypatch.setattr(engine_lib.Engine, "_groups", lambda self, slots: (
        [list(slots[:1]), list(slots[1:])] if len(slots) > 1 else [list(slots)]))
  engine, _ = load.engine(tiny_run, slots=4, page_size=16, cache_bytes=None, max_queue=16,
                          decode_steps=decode_steps)
  if budget_pages:
    engine, _ = load.engine(tiny_run, slots=4, page_size=16, max_queue=16,
                            cache_bytes=budget_pages * _page_bytes(engine),
                            decode_steps=decode_steps)
    assert engine.limits.num_pages == budget_pages
  engine.start()
  compiled = [f._cache_size() for f in (engine.programs._prefill, engine.programs._decode)]
  buckets = {(r, s) for r in engine.programs.row_buckets for s in engine.programs.page_buckets}
  assert set(engine.call_seconds) == buckets  # every decode bucket timed at start-up
  try:
    ids = [engine.tok.encode(p) for p in PROMPTS]
    lengths = [40, 12, 33, 5, 24, 17]
    got = _generate(engine, ids, lengths)
  finally:
    engine.stop()
  # every program compiled at start-up: none while serving
  assert [f._cache_size() for f in (engine.programs._prefill, engine.programs._decode)] == compiled
  if apart:
    assert engine.counts["decode_calls"] > engine.counts["decode_steps"] / decode_steps
  if budget_pages:
    assert engine.counts["preemptions"] > 0
  else:  # four prompts of one padded length together, then the two that waited
    assert engine.counts["prefill_calls"] < len(PROMPTS)
  for prompt, n, (tokens, reason) in zip(ids, lengths, got):
    want = _sample_tokens(tiny_run, prompt, n)
    bos = engine.tok.bos_id
    if bos in want:  # <|bos|> ends a completion
      want = want[:want.index(bos) + 1]
    assert tokens == want and reason == ("stop" if want[-1] == bos else "length")


def _page_bytes(engine) -> int:
  from flax import nnx

  from bov_jax.model import kvcache
  model = nnx.merge(engine.programs.graphdef, engine.programs.params)
  return kvcache.page_bytes(model, engine.limits.page_size)


def test_decode_calls_are_planned_from_their_timed_costs(tiny_run):
  """32 slots of 16 pages of 4 positions (row buckets of 8, 16, 32; page spans of 4, 8,
  16), each call costing 1 + rows x span / 64 (a call's own cost, then its pages):
  16 sequences of 2 pages and 16 of 16 go in two calls; 30 of 16 pages and 2 of 2 in
  one. Where a call of 32 rows costs more than two of 16 (a CPU's caches outgrown), 32
  sequences of one length go in two calls of 16. Not timed yet: one call."""
  engine, _ = load.engine(tiny_run, slots=32, page_size=4, cache_bytes=None, max_queue=4)
  assert (engine.programs.row_buckets, engine.programs.page_buckets) == ([8, 16, 32],
                                                                        [4, 8, 16])
  held = engine.pool.held
  held[:16], held[16:] = [2] * 16, [16] * 16
  assert [sorted(g) for g in engine._groups(np.arange(32))] == [list(range(32))]
  buckets = [(r, s) for r in (8, 16, 32) for s in (4, 8, 16)]
  engine.call_seconds = {(r, s): 1 + r * s / 64 for r, s in buckets}
  groups = engine._groups(np.arange(32))
  assert [sorted(g) for g in groups] == [list(range(16)), list(range(16, 32))]
  held[:2], held[2:] = [2] * 2, [16] * 30
  assert [sorted(g) for g in engine._groups(np.arange(32))] == [list(range(32))]
  held[:] = [8] * 32
  assert len(engine._groups(np.arange(32))) == 1
  engine.call_seconds[(32, 8)] = 2 * engine.call_seconds[(16, 8)] + 0.1
  assert [len(g) for g in engine._groups(np.arange(32))] == [16, 16]


def test_requests_wait_while_the_next_call_needs_the_free_pages(tiny_run):
  """4 free pages of 16 positions, 16 decode steps a call, three requests of 15-token
  prompts and 40 tokens to draw: each needs 1 page for its prompt and 2 by the end of
  its first call. The first two are admitted (2 + 2 pages); the third's prompt would
  fit the free pages, but they go to the others' growth: it waits, and no sequence is
  preempted for it. When the first ends, it is admitted."""
  engine, _ = load.engine(tiny_run, slots=4, page_size=16, cache_bytes=None, max_queue=4,
                          decode_steps=16)
  engine, _ = load.engine(tiny_run, slots=4, page_size=16, max_queue=4, decode_steps=16,
                          cache_bytes=5 * _page_bytes(engine))
  for _ in range(3):
    engine.submit(engine_lib.Request(prompt=list(range(1, 16)), max_tokens=40,
                                     on_event=lambda *a: None))
  admitted = engine._admit()
  assert [slot for slot, _ in admitted] == [0, 1] and len(engine.queue) == 1
  assert len(engine.pool.free) == 2
  engine._free(0)  # the first ends: its page serves the third's growth
  assert [slot for slot, _ in engine._admit()] == [0] and not engine.queue


def test_engine_settings_out_of_range_are_named(tiny_run):
  for kw, says in [(dict(slots=0), "--slots=0"), (dict(decode_steps=0), "--decode_steps=0"),
                   (dict(cache_bytes=10), "--cache_bytes=10 holds 0 page(s)")]:
    args = {**dict(slots=2, page_size=16, cache_bytes=None, max_queue=4), **kw}
    with pytest.raises(ValueError, match=re.escape(says)):
      load.engine(tiny_run, **args)


def test_bank_layers_pages_hold_keys_only(tiny_run):
  """The tiny run's bank layer (the second of two) keeps no values: a page holds three
  buffers of 2 kv heads x 32 x 16 positions in float32, not four, and the ids once."""
  engine, _ = load.engine(tiny_run, slots=1, page_size=16, cache_bytes=None, max_queue=1)
  buffer = 2 * 32 * 16 * 4
  assert _page_bytes(engine) == 3 * buffer + 16 * 4
  pool = engine.programs.cache
  assert [sorted(e) for stage in pool["layers"] for e in stage] in ([["k", "v"], ["k"]],
                                                                    [["k"], ["k", "v"]])
  assert pool["ids"].shape == (engine.limits.num_pages, 16)


# -- the server, as users call it ------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_run):
  proc = start("serve", f"--workdir={tiny_run}", "--port=0", "--slots=4", "--max_queue=64",
               devices=1)
  url = None
  for line in proc.stdout:
    m = re.search(r"listening on (http://\S+)", line)
    if m:
      url = m.group(1)
      break
  assert url, "the server did not say where it listens"
  threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
  yield url, proc
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=60) == 0


def _client(url):
  return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(url) -> dict:
  text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
  return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(bov_\w+) (\S+)$", text, re.M)}


def test_completions_with_the_openai_client(server, tiny_run):
  url, _ = server
  client = _client(url)
  name = client.models.list().data[0].id
  prompt = "def "
  r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
  tok = _tokenizer(tiny_run)
  want = _sample_tokens(tiny_run, tok.encode(prompt), 12)
  assert r.choices[0].text == tok.decode(want) and r.choices[0].finish_reason == "length"
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(prompt)), 12)
  ids = client.completions.create(model=name, prompt=tok.encode(prompt), max_tokens=12,
                                  temperature=0)
  assert ids.choices[0].text == r.choices[0].text  # the same prompt as token ids
  chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=12,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].usage.completion_tokens == 12
  a, b = (client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.9,
                                    top_p=0.9, seed=7, extra_body={"top_k": 40})
          for _ in range(2))
  assert a.choices[0].text == b.choices[0].text  # a seed draws the same tokens
  stop = tok.decode(want)[3:5]
  s = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                stop=[stop])
  assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
  assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200


def _tokenizer(workdir):
  return sources.tokenizer(spec_lib.resolve(rundir.config_of(workdir), n_devices=1), workdir)


def test_concurrent_requests_of_different_lengths(server, tiny_run):
  url, _ = server
  client = _client(url)
  tok = _tokenizer(tiny_run)
  lengths = [30, 3, 18, 9, 25, 1, 14, 7]
  prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
  with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
    out = list(pool.map(lambda pn: client.completions.create(
        model="tiny_run", prompt=pn[0], max_tokens=pn[1], temperature=0), zip(prompts, lengths)))
  for prompt, n, r in zip(prompts, lengths, out):
    want = _sample_tokens(tiny_run, tok.encode(prompt), n)
    if tok.bos_id in want:  # <|bos|> ends a completion: counted, not shown
      want = want[:want.index(tok.bos_id) + 1]
      assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == tok.decode([t for t in want if t != tok.bos_id])
    assert r.usage.completion_tokens == len(want)


@pytest.mark.parametrize("body, status, says", [
    ("{not json", 400, "not JSON"),
    ({"model": "other", "prompt": "x"}, 404, "model 'other' does not exist"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens=0 is out of range: expected [1, 63]"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature=3 is out of range: expected [0.0, 2.0]"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p=0 is out of range"),
    ({"prompt": "x " * 200}, 400, "the model's context is 64"),
    ({"prompt": [1, 2, 100000]}, 400, "token id outside [0, 512)"),
    ({"prompt": 5}, 400, "prompt must be a string or a list of token ids"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"prompt": "x", "n": 2}, 400, "only n=1")])
def test_bad_requests_are_named(server, body, status, says):
  url, _ = server
  data = body if isinstance(body, str) else json.dumps(body)
  req = urllib.request.Request(f"{url}/v1/completions", data=data.encode(), method="POST",
                               headers={"Content-Type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req, timeout=30)
  assert e.value.code == status
  message = json.loads(e.value.read())["error"]["message"]
  assert says in message, message


def test_a_client_that_leaves_frees_its_slot(server):
  url, _ = server
  client = _client(url)
  stream = client.completions.create(model="tiny_run", prompt="def ", max_tokens=60,
                                     temperature=0, stream=True)
  next(iter(stream))
  stream.close()
  for _ in range(100):
    m = _metrics(url)
    if m["bov_active_slots"] == 0 and m["bov_cache_pages_used"] == 0:
      break
    time.sleep(0.1)
  assert m["bov_active_slots"] == 0 and m["bov_cache_pages_used"] == 0, m
  assert m["bov_output_tokens_total"] > 0 and "bov_queue_length" in m


def test_overload_is_told_to_retry_and_a_key_is_required_when_set(tiny_run):
  """In process: an engine not started (nothing leaves its queue of one) answers the
  second request 429 with Retry-After; with an API key, a request without it gets 401."""
  from fastapi import testclient

  from bov_jax.serving import server as server_lib
  engine, _ = load.engine(tiny_run, slots=1, page_size=16, cache_bytes=None, max_queue=1)
  app = server_lib.make_app(engine, "m", api_key="sekret", start=False)
  with testclient.TestClient(app) as http:
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    auth = {"Authorization": "Bearer sekret"}
    first = threading.Thread(target=lambda: http.post("/v1/completions", headers=auth,
                                                      json={"prompt": "x", "max_tokens": 2}),
                             daemon=True)
    first.start()
    for _ in range(100):
      if engine.stats()["queue"] == 1:
        break
      time.sleep(0.05)
    r = http.post("/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert "busy" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200  # no key needed outside /v1/
    engine.stop()  # the waiting request ends (503), so the client can close
    first.join(timeout=30)
    assert not first.is_alive()


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(tiny_run):
  proc = start("serve", f"--workdir={tiny_run}", "--port=0", "--slots=2", devices=1)
  url = next(m.group(1) for line in proc.stdout
             if (m := re.search(r"listening on (http://\S+)", line)))
  client = _client(url)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pending = pool.submit(client.completions.create, model="tiny_run", prompt="def ",
                          max_tokens=60, temperature=0)
    for _ in range(100):
      if _metrics(url)["bov_active_slots"] > 0:
        break
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    r = pending.result(timeout=60)
  assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens > 0
  assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_load_of_64_concurrent_clients_loses_nothing(server):
  """256 requests from 64 clients at once, mixed lengths and settings: every one gets its
  tokens, within a time limit."""
  url, _ = server
  client = _client(url)
  rng = np.random.default_rng(0)
  jobs = [(PROMPTS[i % len(PROMPTS)], int(rng.integers(1, 40)), float(rng.choice([0, 0.8])))
          for i in range(256)]
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(64) as pool:
    out = list(pool.map(lambda j: client.completions.create(
        model="tiny_run", prompt=j[0], max_tokens=j[1], temperature=j[2], seed=1), jobs))
  assert time.perf_counter() - t0 < 300
  for (_, n, _), r in zip(jobs, out):
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 0 < r.usage.completion_tokens <= n
    assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == n
