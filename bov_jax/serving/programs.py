"""The engine's two device programs over the paged cache, of fixed shapes so nothing
compiles while serving: prompts prefilled into their slots (a program per padded prompt
length and per number of prompts, 1, 2, 4 or 8: a prefill call costs about the same for
one prompt as for several), and a few decode steps of the active slots (`steps`, as
static decoding's chunks and vLLM's multi-step scheduling: a step's pages are gathered
once for all of them, and the host waits once). Each chooses its next token on the
device with the slot's own sampling settings.

A decode step runs on a bucket of rows and of pages, not on every slot's whole context:
the active slots gathered into the smallest power-of-two row count that holds them, each
reading only the first pages that the longest of them holds (also a power of two). Its
cost follows what is in flight, as vLLM's does, with a few programs compiled at start-up
instead of one per shape."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bov_jax.kernels import sampling as choice
from bov_jax.model import gpt as model_lib
from bov_jax.model import kvcache

PREFILL_ROWS = (1, 2, 4, 8)  # prompts a prefill call takes, padded up to the next


class Sampling:
  """Per-slot sampling settings as arrays [slots] (temperature 0: greedy; top_k 0 and
  top_p 1: off); a token's key is fold_in(key(seed), its index in the generation)."""

  def __init__(self, slots: int):
    self.temperature = np.zeros(slots, np.float32)
    self.top_k = np.zeros(slots, np.int32)
    self.top_p = np.ones(slots, np.float32)
    self.seed = np.zeros(slots, np.int32)

  def set(self, slot: int, temperature: float, top_k: int, top_p: float, seed: int) -> None:
    self.temperature[slot], self.top_k[slot] = temperature, top_k
    self.top_p[slot], self.seed[slot] = top_p, seed

  def all(self) -> tuple:
    return self.temperature, self.top_k, self.top_p, self.seed


def choose(logits_SV, temperature_S, top_k_S, top_p_S, seed_S, index_S, sampler: str):
  """One token per row: greedy (kernels/sampling.py's, the first largest logit) where the
  temperature is 0, else drawn from softmax(logits / temperature) cut to the top k and
  to the smallest set whose probability reaches top_p. Only the steps some row needs
  run: sorting the vocabulary costs more than a small model's decode step on a CPU."""
  greedy = choice.greedy(logits_SV, sampler).astype(jnp.int32)
  V = logits_SV.shape[-1]

  def cut(z):
    desc = -jnp.sort(-z, axis=-1)
    k = jnp.where(top_k_S > 0, jnp.minimum(top_k_S, V), V)
    top_k_floor = jnp.take_along_axis(desc, (k - 1)[:, None], axis=1)
    mass = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
    last = jnp.minimum(jnp.sum(mass < top_p_S[:, None], axis=-1), V - 1)
    top_p_floor = jnp.take_along_axis(desc, last[:, None], axis=1)
    return jnp.where(z >= jnp.maximum(top_k_floor, top_p_floor), z, -jnp.inf)

  def drawn():
    z = logits_SV / jnp.where(temperature_S > 0, temperature_S, 1.0)[:, None]
    cuts = (temperature_S > 0) & ((top_k_S > 0) | (top_p_S < 1.0))
    z = jax.lax.cond(jnp.any(cuts), cut, lambda z: z, z)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_S, index_S)
    out = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    return jnp.where(temperature_S > 0, out, greedy)

  return jax.lax.cond(jnp.any(temperature_S > 0), drawn, lambda: greedy)


class Programs:
  """The model's parameters and paged cache on the device, and the programs over them."""

  def __init__(self, graphdef, params, slots: int, num_pages: int, page_size: int,
               max_pages: int, cache: dict | None = None, steps: int = 1):
    """`cache`: one of these shapes to start from (default: an empty one, allocated);
    ShapeDtypeStructs with `params` as ShapeDtypeStructs, to lower the programs only.
    `steps`: decode steps a decode call runs."""
    self.graphdef, self.params = graphdef, params
    self.slots, self.page_size, self.max_pages = slots, page_size, max_pages
    self.steps = steps
    model = nnx.merge(graphdef, params)
    self.sampler, self.vocab_size = model.spec.sampler, model.spec.vocab_size
    if cache is None:  # on the parameters' devices
      where = jax.tree.leaves(params)[0].sharding
      here = NamedSharding(where.mesh, P()) if isinstance(where, NamedSharding) else where
      cache = jax.jit(functools.partial(kvcache.init_paged, model, slots, num_pages, page_size,
                                        max_pages), out_shardings=here)()
    self.cache = cache
    # Each program returns the cache placed as it took it: a cache placed otherwise (the
    # compiler's own choice) would make the next program compile again while serving.
    keep = jax.tree.map(lambda x: x.sharding, cache)
    outs = (jax.tree.leaves(keep)[0], keep)  # (tokens, cache)
    self._prefill = jax.jit(self._prefill_fn, donate_argnums=1, static_argnames="pages",
                            out_shardings=outs)
    self._decode = jax.jit(self._decode_fn, donate_argnums=1, static_argnames="pages",
                           out_shardings=outs)
    self.row_buckets = _powers(min(8, slots), slots)
    self.page_buckets = _powers(min(4, max_pages), max_pages)
    self.prefill_rows = [n for n in PREFILL_ROWS if n <= slots]

  def _prefill_fn(self, params, cache, pages_SM, ids_NT, length_N, slot_N, temperature_S,
                  top_k_S, top_p_S, seed_S, index_N, *, pages):
    """Prompts `ids_NT` (padded) into the slots `slot_N`: their cache rows, and each one's
    first new token (a row repeated to fill the bucket writes what it wrote)."""
    model = nnx.merge(self.graphdef, params)
    n = jnp.arange(ids_NT.shape[0])
    some = dict(cache, prev=cache["prev"][slot_N], pos=jnp.zeros_like(length_N),
                pages=pages_SM[slot_N, :pages])
    h_NTD, some = model.hidden(ids_NT, some)
    pre = model_lib.rmsnorm(model.wte[...].astype(model.compute_dtype)[ids_NT[n, length_N - 1]])
    cache = dict(some, prev=cache["prev"].at[slot_N].set(pre),
                 pos=cache["pos"].at[slot_N].set(length_N), pages=pages_SM)
    logits_NV = model.logits(h_NTD[n, length_N - 1])  # the head at each prompt's end only
    token = choose(logits_NV, temperature_S[slot_N], top_k_S[slot_N], top_p_S[slot_N],
                   seed_S[slot_N], index_N, self.sampler)
    return token, cache

  def _decode_fn(self, params, cache, pages_SM, tokens_S, active_S, temperature, top_k, top_p,
                 seed, index_S, rows_A, *, pages):
    """`self.steps` steps of the slots `rows_A` (the active ones, then inactive ones to
    fill the bucket), each reading its first `pages` pages. Tokens [S, steps]. One step
    reads the pages where they lie; several gather them once into a contiguous cache
    (a copy of the rows' pages, held for the call), decode over it and write back what
    they added."""
    model = nnx.merge(self.graphdef, params)
    on_A = active_S[rows_A]  # rows that fill the bucket write page 0 and keep their state
    table_AM = jnp.where(on_A[:, None], pages_SM[rows_A, :pages], 0)
    start_A = jnp.where(on_A, cache["pos"][rows_A], 0)
    keep = lambda old, new: jnp.where(on_A.reshape(-1, *[1] * (new.ndim - 1)), new, old)  # noqa
    settings = (temperature[rows_A], top_k[rows_A], top_p[rows_A], seed[rows_A])
    if self.steps == 1:  # read in place, a layer's pages at a time: no copy of the cache
      some = dict(cache, pages=table_AM, prev=cache["prev"][rows_A], pos=start_A)
      logits, some = model(tokens_S[rows_A][:, None], some)
      cache = dict(some, pages=pages_SM,
                   prev=cache["prev"].at[rows_A].set(keep(cache["prev"][rows_A], some["prev"])),
                   pos=cache["pos"].at[rows_A].set(keep(cache["pos"][rows_A], some["pos"])))
      out = choose(logits[:, 0], *settings, index_S[rows_A], self.sampler)
      return jnp.zeros((tokens_S.shape[0], 1), tokens_S.dtype).at[rows_A, 0].set(out), cache
    local = dict(kvcache.gather_pages(cache, table_AM, model.spec.n_kv_head),
                 prev=cache["prev"][rows_A], pos=start_A)

    def step(carry, i):
      local, token_A = carry
      logits, local = model(token_A[:, None], local)
      token_A = choose(logits[:, 0], *settings, index_S[rows_A] + i, self.sampler)
      return (local, token_A), token_A

    (local, _), out_KA = jax.lax.scan(step, (local, tokens_S[rows_A]), jnp.arange(self.steps))
    cache = kvcache.scatter_pages(cache, local, table_AM, start_A, self.steps,
                                  model.spec.n_kv_head)
    cache = dict(cache,
                 prev=cache["prev"].at[rows_A].set(keep(cache["prev"][rows_A], local["prev"])),
                 pos=cache["pos"].at[rows_A].set(keep(cache["pos"][rows_A], local["pos"])))
    out_SK = jnp.zeros((tokens_S.shape[0], self.steps), tokens_S.dtype)
    return out_SK.at[rows_A].set(out_KA.T), cache

  def prefill(self, prompts: list[tuple[int, list[int], int]], padded: int, pages,
              sampling: tuple) -> list[int]:
    """Runs prompts (slot, ids, index of the token it draws) padded to `padded` positions
    into their slots, at most the largest of `prefill_rows` at once; each one's first new
    token. `sampling`: every slot's settings (Sampling.all)."""
    size = next(n for n in self.prefill_rows if n >= len(prompts))
    rows = prompts + [prompts[0]] * (size - len(prompts))  # repeats write what they wrote
    buf = np.zeros((size, padded), np.int32)
    for i, (_, ids, _) in enumerate(rows):
      buf[i, :len(ids)] = ids
    length = np.asarray([len(ids) for _, ids, _ in rows], np.int32)
    slot = np.asarray([s for s, _, _ in rows], np.int32)
    index = np.asarray([k for _, _, k in rows], np.int32)
    tokens, self.cache = self._prefill(
        self.params, self.cache, pages, buf, length, slot, *sampling, index,
        pages=min(self.max_pages, -(-padded // self.page_size)))
    return [int(t) for t in np.asarray(tokens)[:len(prompts)]]

  def decode(self, tokens, active, pages, sampling: tuple, index, held: int | None = None,
             rows: int | None = None) -> np.ndarray:
    """Every slot's next `steps` tokens [slots, steps] (0 where inactive), each active
    slot's input token run at its position, then each token it draws; `held`: the most
    pages an active slot holds (default: all), enough for the steps' positions. `rows`
    and `held` pick the bucket (default: the smallest that holds them)."""
    active = np.asarray(active, bool)
    on = np.flatnonzero(active)
    size = rows or next(n for n in self.row_buckets if n >= len(on))
    rows_A = np.concatenate([on, np.flatnonzero(~active)[:size - len(on)]]).astype(np.int32)
    span = next(n for n in self.page_buckets if n >= (held or self.max_pages))
    out, self.cache = self._decode(self.params, self.cache, pages, tokens, active, *sampling,
                                   index, rows_A, pages=span)
    return np.asarray(out)

  def lower_decode(self, rows: int, span: int):
    """The decode step of one bucket (`rows` slots, `span` pages), lowered on the devices
    of the cache: its compiled figures without running it (training/aot.py's way)."""
    where = jax.tree.leaves(self.cache)[0].sharding
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=where)  # noqa: E731
    S, f32, i32 = self.slots, np.float32, np.int32
    return self._decode.lower(
        self.params, self.cache, arg((S, self.max_pages), i32), arg((S,), i32), arg((S,), bool),
        arg((S,), f32), arg((S,), i32), arg((S,), f32), arg((S,), i32), arg((S,), i32),
        arg((rows,), i32), pages=span)

  def warm(self, num_pages: int, runs: int = 2) -> dict:
    """Compiles the decode step of every bucket (rows, span), then times it: the
    seconds of each, the fastest of `runs` calls, every row active on distinct pages
    where the pool has them. A call's cost is no product of its rows and pages (on a CPU
    it jumps where a call's cache outgrows the processor's caches), so the engine plans
    its calls from these, as vLLM sizes its cache from a profiling run. Call before any
    sequence is in flight: the calls write into pages no sequence holds, and a prefill
    sets all a sequence reads."""
    S, M = self.slots, self.max_pages
    table = (1 + np.arange(S * M) % (num_pages - 1)).reshape(S, M).astype(np.int32)
    zeros = np.zeros(S, np.int32)
    sampling = (np.zeros(S, np.float32), zeros, np.ones(S, np.float32), zeros)
    zero = lambda x: jnp.zeros_like(x, device=x.sharding)  # noqa: E731
    out = {}
    for rows in self.row_buckets:
      active = np.arange(S) < rows
      for span in self.page_buckets:
        seconds = []
        for _ in range(runs + 1):  # the first compiles
          self.cache = dict(self.cache, pos=zero(self.cache["pos"]))
          t0 = time.perf_counter()
          self.decode(zeros, active, table, sampling, zeros, span, rows)
          seconds.append(time.perf_counter() - t0)
        out[(rows, span)] = min(seconds[1:])
    self.cache = dict(self.cache, pos=zero(self.cache["pos"]), prev=zero(self.cache["prev"]))
    return out


def _powers(lo: int, hi: int) -> list[int]:
  """lo, 2 lo, 4 lo, ... below hi, then hi."""
  out = []
  while lo < hi:
    out.append(lo)
    lo *= 2
  return out + [hi]
