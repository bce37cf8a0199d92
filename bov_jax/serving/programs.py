"""The engine's two device programs over the paged cache, of fixed shapes so nothing
compiles while serving: a prompt prefilled into one slot (one program per padded prompt
length), and one decode step of every slot at once. Each chooses its next token on the
device with the slot's own sampling settings."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.kernels import sampling as choice
from bov_jax.model import gpt as model_lib
from bov_jax.model import kvcache


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

  def row(self, slot: int) -> tuple:
    return (self.temperature[slot:slot + 1], self.top_k[slot:slot + 1],
            self.top_p[slot:slot + 1], self.seed[slot:slot + 1])

  def all(self) -> tuple:
    return self.temperature, self.top_k, self.top_p, self.seed


def choose(logits_SV, temperature_S, top_k_S, top_p_S, seed_S, index_S, sampler: str):
  """One token per row: greedy (kernels/sampling.py's, the first largest logit) where the
  temperature is 0, else drawn from softmax(logits / temperature) cut to the top k and
  to the smallest set whose probability reaches top_p."""
  greedy = choice.greedy(logits_SV, sampler)
  V = logits_SV.shape[-1]
  z = logits_SV / jnp.where(temperature_S > 0, temperature_S, 1.0)[:, None]
  desc = -jnp.sort(-z, axis=-1)
  k = jnp.where(top_k_S > 0, jnp.minimum(top_k_S, V), V)
  top_k_floor = jnp.take_along_axis(desc, (k - 1)[:, None], axis=1)
  mass = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
  last = jnp.minimum(jnp.sum(mass < top_p_S[:, None], axis=-1), V - 1)
  top_p_floor = jnp.take_along_axis(desc, last[:, None], axis=1)
  z = jnp.where(z >= jnp.maximum(top_k_floor, top_p_floor), z, -jnp.inf)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_S, index_S)
  drawn = jax.vmap(jax.random.categorical)(keys, z)
  return jnp.where(temperature_S > 0, drawn, greedy).astype(jnp.int32)


class Programs:
  """The model's parameters and paged cache on the device, and the programs over them."""

  def __init__(self, graphdef, params, slots: int, num_pages: int, page_size: int,
               max_pages: int):
    self.graphdef, self.params = graphdef, params
    self.slots, self.page_size = slots, page_size
    model = nnx.merge(graphdef, params)
    self.sampler, self.vocab_size = model.spec.sampler, model.spec.vocab_size
    self.cache = jax.jit(functools.partial(kvcache.init_paged, model, slots, num_pages,
                                           page_size, max_pages))()
    self._prefill = jax.jit(self._prefill_fn, donate_argnums=1)
    self._decode = jax.jit(self._decode_fn, donate_argnums=1)

  def _prefill_fn(self, params, cache, pages_SM, ids_1T, length, slot, temperature, top_k,
                  top_p, seed, index):
    model = nnx.merge(self.graphdef, params)
    one = dict(cache, prev=cache["prev"][slot][None], pos=jnp.zeros((1,), jnp.int32),
               pages=pages_SM[slot][None])
    logits, one = model(ids_1T, one)
    pre = model_lib.rmsnorm(model.wte[...].astype(model.compute_dtype)[ids_1T[0, length - 1]])
    cache = dict(one, prev=cache["prev"].at[slot].set(pre), pos=cache["pos"].at[slot].set(length),
                 pages=pages_SM)
    last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, axis=0)  # [1, V]
    token = choose(last, temperature, top_k, top_p, seed, index, self.sampler)
    return token[0], cache

  def _decode_fn(self, params, cache, pages_SM, tokens_S, active_S, temperature, top_k, top_p,
                 seed, index_S):
    model = nnx.merge(self.graphdef, params)
    cache = dict(cache, pages=pages_SM, pos=jnp.where(active_S, cache["pos"], 0))
    logits, cache = model(tokens_S[:, None], cache)
    return choose(logits[:, 0], temperature, top_k, top_p, seed, index_S, self.sampler), cache

  def prefill(self, slot: int, ids: list[int], padded: int, pages, sampling: tuple,
              index: int) -> int:
    """Runs a prompt (padded to `padded` positions) into `slot`; its first new token."""
    buf = np.zeros((1, padded), np.int32)
    buf[0, :len(ids)] = ids
    token, self.cache = self._prefill(self.params, self.cache, pages, buf, np.int32(len(ids)),
                                      np.int32(slot), *sampling, np.asarray([index], np.int32))
    return int(token)

  def decode(self, tokens, active, pages, sampling: tuple, index) -> np.ndarray:
    """Every slot's next token, each active slot's input token run at its position."""
    out, self.cache = self._decode(self.params, self.cache, pages, tokens, active, *sampling,
                                   index)
    return np.asarray(out)
