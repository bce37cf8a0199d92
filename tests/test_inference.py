"""Cached decoding: exact against the full forward pass, no value cache for bank layers."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bov_jax.inference import generate as inference
from bov_jax.inference import sampling
from bov_jax.kernels import attention
from bov_jax.kernels import sampling as choice
from bov_jax.model import gpt as model_lib
from bov_jax.model import kvcache
from bov_jax.settings import values
from tests.helpers import model_spec
from tests.helpers import random_model
from tests.helpers import small_config


def _model(preset, **kw):
  return random_model(small_config(preset, **kw), scale=0.1)


def _shapes(preset):
  """The model's structure alone (what a cache's layout depends on), nothing computed."""
  return model_lib.abstract(model_spec(small_config(preset)))


SCANNED = ["gpt_base", "gpt_base_v_from_value_emb_learn", "gpt_base_v_from_v1_every_layer",
           "gpt_base_v_from_x0_learn", "gpt_base_v_from_value_emb_learn_shared"]


@pytest.mark.slow
@pytest.mark.parametrize("preset, scan", [(p, "auto") for p in sorted(values.PRESETS)]
                         + [(p, "true") for p in SCANNED])
def test_prefill_and_decode_equal_full_forward(preset, scan):
  """Every step's logits, past the 8-token sliding window, for every value mode; and
  with the layers as scanned stages (each stage's cache stacked) for some."""
  m = _model(preset, n_layer=4, sequence_len=48, short_window=8, scan=scan)
  assert any(s.scanned for s in m.spec.stages) == (scan == "true")
  _prefill_and_decode_equal_full_forward(m)


def test_bank_layers_in_blocks_decode_as_the_full_forward(monkeypatch):
  """The same with the bank layers' values gathered in blocks of 16 cached positions."""
  monkeypatch.setattr(kvcache, "BANK_BLOCK", 16)
  _prefill_and_decode_equal_full_forward(
      _model("gpt_base_v_from_value_emb_learn", n_layer=4, sequence_len=48, short_window=8,
             window_pattern="L"))


def _prefill_and_decode_equal_full_forward(m):
  graphdef, state = nnx.split(m)
  rng = np.random.default_rng(0)
  seq = jnp.asarray(rng.integers(0, 100, (2, 30)), jnp.int32)
  P = 5
  full = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, seq)

  @jax.jit
  def prefill(s, x):
    mm = nnx.merge(graphdef, s)
    return mm(x, kvcache.init(mm, 2, 48))

  @jax.jit
  def step(s, x, cache):
    return nnx.merge(graphdef, s)(x, cache)

  logits, cache = prefill(state, seq[:, :P])
  np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, :P]), atol=2e-4)
  for t in range(P, 30):
    logits, cache = step(state, seq[:, t:t + 1], cache)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(full[:, t]), atol=2e-4,
                               err_msg=f"position {t}")


def test_decode_step_reads_only_the_window():
  """A sliding-window layer's decode step cuts the cache to the window + 1
  positions its query sees (clamped at the cache's start); windows over half the
  cache are read whole."""
  start = jnp.asarray([3, 40], jnp.int32)
  buf = jnp.arange(2 * 2 * 48, dtype=jnp.float32).reshape(4, 48, 1)  # rows b * K + h
  ids = jnp.arange(2 * 48).reshape(2, 48)
  rows, seqs, kpos = kvcache._window(8, start, 48, 2)
  np.testing.assert_array_equal(np.asarray(kpos), [list(range(0, 9)), list(range(32, 41))])
  lo_N = np.asarray([0, 0, 32, 32])  # each row takes its sequence's window
  np.testing.assert_array_equal(np.asarray(rows(buf))[:, :, 0],
                                np.arange(4)[:, None] * 48 + lo_N[:, None] + np.arange(9))
  np.testing.assert_array_equal(np.asarray(seqs(ids)), np.asarray(kpos) + [[0], [48]])
  assert kvcache._window(24, start, 48, 2) is None  # 25 of 48 positions: read whole


def test_bank_layers_keep_no_values():
  def keeps_values(preset):
    m = _shapes(preset)
    cache = kvcache.init(m, 1, 32)
    layers = kvcache.by_layer(m.spec, cache)
    assert len(layers) == 6 and all(c["k"].shape == (2, 32, 16) for c in layers)
    return [i for i, c in enumerate(layers) if "v" in c], "ids" in cache

  assert keeps_values("gpt_base_v_from_value_emb_learn") == ([0, 1, 2, 3], True)  # banks 4, 5
  assert keeps_values("gpt_base_v_from_v1_learn") == ([0, 1, 2, 3], False)  # reuse layer 0's
  assert keeps_values("gpt_base") == (list(range(6)), False)
  # V + E[id] depends on context
  assert keeps_values("gpt_base_add_init_value_emb_learn") == (list(range(6)), False)


@pytest.mark.parametrize("batch, context", [(1, 64), (3, 256)])
def test_memory_formula(batch, context):
  base = kvcache.init(_shapes("gpt_base"), batch, context)
  bov_model = _shapes("gpt_base_v_from_value_emb_learn")
  bov = kvcache.init(bov_model, batch, context)
  n_bank = sum(b.attn.layer_value.is_bank for b in bov_model.blocks)
  kv_dim, bpe = 2 * 16, 4
  saved = kvcache.nbytes(base) - kvcache.nbytes(bov)
  ids = batch * context * 4
  assert n_bank == 2
  assert saved == n_bank * kv_dim * context * bpe * batch - ids


@pytest.mark.slow
def test_ragged_batch_equals_one_by_one():
  m = _model("gpt_base_v_from_value_emb_learn", sequence_len=64, short_window=8)
  graphdef, state = nnx.split(m)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(3)
  a, b = rng.integers(0, 100, 3).tolist(), rng.integers(0, 100, 11).tolist()
  prompts = np.zeros((2, 11), np.int32)
  prompts[0, :3], prompts[1] = a, b
  out = np.asarray(inference.generate(graphdef, params, jnp.asarray(prompts), jnp.asarray([3, 11]),
                                      jax.random.key(0), context=64, max_new_tokens=20))
  assert out[0].tolist() == inference.generate_cached(graphdef, params, a, 20, 64)
  assert out[1].tolist() == inference.generate_cached(graphdef, params, b, 20, 64)


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.8, 5)])
def test_stream_gives_generates_tokens_chunk_by_chunk(temperature, top_k):
  """stream: the same tokens as generate (greedy and sampled: the keys follow the step,
  not the chunk), in chunks of 8 with the last cut to max_new_tokens."""
  m = _model("gpt_base_v_from_value_emb_learn", sequence_len=64, short_window=8)
  graphdef, state = nnx.split(m)
  params = nnx.to_pure_dict(state)
  prompts = np.zeros((2, 11), np.int32)
  prompts[0, :3], prompts[1] = [5, 17, 3], np.arange(11) + 20
  args = (graphdef, params, jnp.asarray(prompts), jnp.asarray([3, 11]), jax.random.key(4))
  kw = dict(context=64, max_new_tokens=20, temperature=temperature, top_k=top_k)
  whole = np.asarray(inference.generate(*args, **kw))
  chunks = list(inference.stream(*args, chunk=8, **kw))
  assert [c.shape for c in chunks] == [(2, 8), (2, 8), (2, 4)]
  np.testing.assert_array_equal(np.concatenate(chunks, axis=1), whole)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.8, 5)])
def test_cached_equals_uncached_generation(temperature, top_k):
  m = _model("gpt_base_v_from_value_emb_learn", sequence_len=64, short_window=8)
  graphdef, state = nnx.split(m)
  params = nnx.to_pure_dict(state)
  prompt = [5, 17, 3, 99]
  a = inference.generate_cached(graphdef, params, prompt, 48, 64, temperature, top_k, seed=7)
  b = inference.generate_uncached(graphdef, params, prompt, 48, 64, temperature, top_k, seed=7)
  assert a == b and len(a) == 48


def test_cache_holds_only_what_the_generation_reaches():
  """A 4-token prompt and 10 new tokens at a 512-token context decode from a
  128-position cache, to the same tokens as the full forward pass at 512."""
  assert inference.cache_length(4, 10) == 128 and inference.cache_length(100, 60) == 256
  m = _model("gpt_base_v_from_value_emb_learn", sequence_len=512, short_window=8)
  graphdef, state = nnx.split(m)
  params = nnx.to_pure_dict(state)
  prompt = [5, 17, 3, 99]
  args = (graphdef, params, jnp.asarray([prompt]), jnp.asarray([4]), jax.random.key(0))
  hlo = inference.generate.lower(*args, context=512, max_new_tokens=10).as_text()
  a = m.blocks[0].attn
  assert f"{a.n_kv_head}x128x{a.head_dim}xf32" in hlo and f"x512x{a.head_dim}xf32" not in hlo
  assert (inference.generate_cached(graphdef, params, prompt, 10, 512)
          == inference.generate_uncached(graphdef, params, prompt, 10, 512))


FORMS = ["cpu", "jax"]  # the hand-written CPU forms and jax's own (kernels/sampling.py)


@pytest.mark.parametrize("form", FORMS)
def test_top_k_sampling_stays_in_top_k(form):
  logits = jnp.asarray([[0.0, 5.0, 4.0, -1.0, 3.0]])
  keys = jax.random.split(jax.random.key(0), 200)  # 200 draws in one compiled call
  draws = jax.vmap(lambda k: sampling.sample_logits(logits, k, 1.0, 2, form))(keys)
  seen = set(np.asarray(draws).ravel().tolist())
  assert seen == {1, 2}
  assert int(sampling.sample_logits(logits, jax.random.key(0), 0.0, 0, form)[0]) == 1


def test_top_k_keeps_what_lax_top_k_keeps():
  """The k-th largest by bisection equals lax.top_k's k-th value: ties, negatives,
  -inf entries, k = 1 and k = V."""
  rng = np.random.default_rng(1)
  for V, k in [(10, 3), (4096, 50), (100, 1), (7, 7), (300, 40)]:
    z = np.round(rng.normal(size=(3, V)) * 3, 1).astype(np.float32)
    z[0, :2] = -np.inf
    kth = np.asarray(jax.lax.top_k(jnp.asarray(z), k)[0][:, -1:])
    kept = np.asarray(choice.top_k_mask(jnp.asarray(z), k, "cpu"))
    np.testing.assert_array_equal(kept, z >= kth, err_msg=f"V={V} k={k}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_softmax(temperature, form):
  p = np.asarray([0.1, 0.2, 0.3, 0.4, 0.0])
  logits = jnp.log(jnp.asarray(p, jnp.float32))[None]
  n = 20000
  keys = jax.random.split(jax.random.key(0), n)
  toks = np.asarray(jax.vmap(lambda k: sampling.sample_logits(logits, k, temperature, 0, form))(keys))
  want = p ** (1 / temperature) / np.sum(p ** (1 / temperature))
  freq = np.bincount(toks.ravel(), minlength=5) / n
  np.testing.assert_allclose(freq, want, atol=4 * np.sqrt(0.25 / n))
  assert freq[4] == 0


@pytest.mark.slow
def test_tables_in_host_memory_decode_the_same():
  from bov_jax.parallel import lookup
  if not lookup.host_memory_supported():
    pytest.skip("this backend has no pinned_host memory")
  m = _model("gpt_base_v_from_value_emb_learn", sequence_len=64, short_window=8)
  graphdef, state = nnx.split(m)
  params = jax.device_put(nnx.to_pure_dict(state), jax.devices()[0])
  want = inference.generate_cached(graphdef, params, [5, 17, 3], 16, 64)
  import dataclasses

  from bov_jax.model import gpt as model_lib
  hgraph = nnx.graphdef(model_lib.abstract(dataclasses.replace(m.spec, tables_on_host=True)))
  hparams = inference.tables_to_host(params)
  assert all(t.sharding.memory_kind == "pinned_host" for t in hparams["tables"].values())
  assert hparams["wte"].sharding.memory_kind != "pinned_host"
  assert inference.generate_cached(hgraph, hparams, [5, 17, 3], 16, 64) == want


@pytest.mark.slow
@pytest.mark.parametrize("preset, batch", [("gpt_base", 1), ("gpt_base_v_from_value_emb_learn", 1),
                                           ("gpt_base_v_from_v1_learn", 2)])
def test_decoding_never_copies_the_cache(preset, batch):
  """The compiled generate loop updates every cache buffer in place: no copy or
  transpose the size of a layer's cache. Decoding at 4,096 positions ran 2x slower
  with a token-major cache (a transpose per layer and step) or with XLA copying
  each buffer twice per step (a size-1 batch dimension in attention's matmuls).
  (Copies on the way into the loop, once per call, are not counted.)"""
  m = _model(preset)
  graphdef, state = nnx.split(m)
  params = nnx.to_pure_dict(state)
  context = 72
  a = m.blocks[0].attn
  cache_elems = batch * a.n_kv_head * context * a.head_dim
  prompts = jnp.ones((batch, 5), jnp.int32)
  hlo = inference.generate.lower(graphdef, params, prompts, jnp.full((batch,), 5), jax.random.key(0),
                                 context=context, max_new_tokens=8).compile().as_text()
  comps = dict(re.findall(r"\n(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
  bodies = re.findall(r" while\(.*?body=%?([\w.\-]+)", hlo)
  seen, todo = set(), list(bodies)
  while todo:  # the loop body and every computation it calls (fusions)
    name = todo.pop()
    if name not in seen:
      seen.add(name)
      todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name])
  moved = []
  for name in seen:
    for dims, op in re.findall(r"= [a-z0-9]+\[([0-9,]*)\]\{[0-9,]*\} (copy|transpose)\(",
                               comps[name]):
      if dims and math.prod(int(d) for d in dims.split(",")) == cache_elems:
        moved.append(f"{op} [{dims}] in {name}")
  assert bodies and not moved, moved


def test_greedy_is_argmax():
  """The first index of the largest logit, ties included, over any leading shape."""
  rng = np.random.default_rng(0)
  z = rng.normal(size=(3, 5, 4096)).astype(np.float32)
  z[0, 0, [7, 4000]] = 50.0  # a tie: the first wins
  z[1, 2, -1] = 60.0         # the last entry
  z = np.round(z, 1)         # many equal values
  got = np.asarray(choice.greedy(jnp.asarray(z), "cpu"))
  np.testing.assert_array_equal(got, np.argmax(z, axis=-1))
  assert got.dtype == np.int32 and got[0, 0] == 7


def test_bank_layer_attends_block_by_block_as_whole():
  """A bank layer's XLA path over a long cache gathers its rows a block at a time
  (online softmax): the output equals gathering them all, with blocks before the
  window, after the query, and partly visible."""
  spec = model_spec(small_config("gpt_base_v_from_value_emb_learn", n_embd=64, n_head=4,
                                 n_kv_head=2))
  ls = kvcache.layer_settings(spec, spec.layers[-1], 10)
  rng = np.random.default_rng(0)
  B, T, H, K, E, S, V = 2, 3, 4, 2, 16, 64, 50
  q = jnp.asarray(rng.normal(size=(B, T, H, E)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B * K, S, E)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
  table = jnp.asarray(rng.normal(size=(V, K * E)), jnp.float32)
  qpos = jnp.asarray([[10, 11, 12], [58, 59, 60]])  # the second sees only the last block
  got = kvcache.bank_in_blocks(ls, q, k, ids, table, {"gamma": jnp.float32(0.7)}, qpos, 16)
  rows = attention.kv_rows((0.7 * table[ids]).reshape(B, S, K, E))
  want = attention.attend(q, k, rows, qpos, jnp.broadcast_to(jnp.arange(S), (B, S)), 10)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_a_prompt_the_context_cannot_continue_is_named():
  assert inference.prompt_too_long(63, 64) is None
  assert inference.prompt_too_long(64, 64) == "sample.prompt is 64 tokens, the context is 64"


def test_pages_gathered_as_a_contiguous_cache_and_written_back():
  """gather_pages reads each table row's pages as one contiguous sequence; scatter_pages
  writes the T positions from each start back into the page holding each, page 0 where
  the row's table holds none, and leaves every other position as it was."""
  model = _shapes("gpt_base_v_from_value_emb_learn")  # a bank layer: keys only there, ids
  K, page = model.spec.n_kv_head, 4
  rng = np.random.default_rng(0)
  pool = kvcache.init_paged(model, slots=2, num_pages=8, page_size=page, max_pages=3)
  pool = jax.tree.map(lambda x: jnp.asarray(rng.integers(0, 100, x.shape).astype(x.dtype)), pool)
  table = jnp.asarray([[3, 5, 0], [6, 2, 7]], jnp.int32)  # row 0 holds 2 pages, row 1 three
  local = kvcache.gather_pages(pool, table, K)
  k_pool, k_local = pool["layers"][0][0]["k"], local["layers"][0][0]["k"]
  assert k_local.shape[2] == 3 * page
  np.testing.assert_array_equal(k_local[:, K * 1:K * 2, page:2 * page], k_pool[:, 2 * K:3 * K])
  np.testing.assert_array_equal(local["ids"][0, :page], pool["ids"][3])
  start, T = jnp.asarray([6, 1], jnp.int32), 3  # row 0: positions 6, 7 (page 5) and 8 (none)
  new = jax.tree.map(lambda x: x + 1000, local)
  out = kvcache.scatter_pages(pool, new, table, start, T, K)
  tables = [[3, 5, 0], [6, 2, 7]]
  for name in ["ids"] + list(range(len(pool["layers"]))):
    if name == "ids":  # [pages, page]
      got, was, add = (np.asarray(x["ids"]) for x in (out, pool, new))
    else:  # [R, pages * K, page, E], as [pages, R, K, page, E]
      got, was, add = (np.asarray(x["layers"][name][0]["k"]) for x in (out, pool, new))
      split = lambda x: np.moveaxis(x.reshape(x.shape[0], -1, K, *x.shape[2:]), 1, 0)  # noqa
      got, was = split(got), split(was)
      add = np.moveaxis(add.reshape(add.shape[0], -1, K, *add.shape[2:]), 1, 0)  # [A, R, K, S, E]
    want = was.copy()
    for row, s in enumerate([6, 1]):
      for t in range(s, s + T):
        p = tables[row][t // page]
        if p:  # page 0 takes what no page holds: not checked
          if name == "ids":
            want[p, t % page] = add[row, t]
          else:
            want[p, :, :, t % page] = add[row, :, :, t]
    np.testing.assert_array_equal(got[1:], want[1:])
