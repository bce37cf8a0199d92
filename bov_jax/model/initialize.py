"""The whole initialisation of the model (the reference's init_weights), in one function."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.model import gpt as model_lib
from bov_jax.model.gpt import GPT
from bov_jax.model.gpt import rmsnorm
from bov_jax.settings.model_spec import ModelSpec


def init_weights(model: GPT, key) -> None:
  """The whole initialisation (the reference's init_weights), in place.

  Every tensor draws from its own key, folded from its name, so two value modes
  built from the same seed share every weight they have in common (this is what
  makes BoV at init equal x0-replace at init).
  """
  D = model.spec.n_embd
  s = np.sqrt(3.0) / np.sqrt(D)
  # What each tensor draws: name -> (distribution, shape, a, b), drawn together below.
  draws = {"wte": ("normal", model.wte.shape, 0.8, 0.0),
           "lm_head": ("normal", model.lm_head.shape, 0.001, 0.0),
           "smear_w": ("uniform", model.smear_w.shape, 0.0, 0.02)}
  for i, block in enumerate(model.blocks):
    a = block.attn
    draws[f"h{i}.wq"] = ("uniform", a.wq.shape, -s, s)
    draws[f"h{i}.wk"] = ("uniform", a.wk.shape, -s, s)
    # Every layer draws its W_v, owned or not: a table is initialised from it.
    draws[f"h{i}.wv"] = ("uniform", (D, a.n_kv_head * a.head_dim), -s, s)
    if a.gate is not None:
      draws[f"h{i}.gate"] = ("uniform", a.gate.shape, 0.0, 0.02)
    draws[f"h{i}.w_fc"] = ("uniform", block.mlp.w_fc.shape, -0.4 * s, 0.4 * s)
  # Value tables: aligned init E_l[t] = rmsnorm(wte[t]) @ W_v,l in fp32, so the first
  # forward pass equals x0-replace; a shared table uses the first target's W_v.
  # The gated variant draws U(-s, s) instead.
  first_target = {}
  for layer, name in sorted(model.table_of.items()):
    first_target.setdefault(name, layer)
  gated = model.spec.value.combine == "gated_add"
  if gated:
    for name in first_target:
      draws[f"table.{name}"] = ("uniform", model.tables[name].shape, -s, s)
  r = _draw(key, draws)  # float32, whatever the stored dtype

  def set_(p, value):
    p.set_value(value.astype(p.dtype))

  set_(model.wte, r["wte"])
  set_(model.lm_head, r["lm_head"])
  set_(model.smear_lambda, jnp.zeros(()))
  set_(model.smear_w, r["smear_w"])
  for i, block in enumerate(model.blocks):
    a = block.attn
    set_(a.wq, r[f"h{i}.wq"])
    set_(a.wk, r[f"h{i}.wk"])
    if a.wv is not None:
      set_(a.wv, r[f"h{i}.wv"])
    set_(a.wo, jnp.zeros(a.wo.shape))
    for name, p in a.coeffs.items():
      set_(p, jnp.asarray(0.0 if name == "beta" else 1.0))
    if a.gate is not None:
      set_(a.gate, r[f"h{i}.gate"])
    set_(block.mlp.w_fc, r[f"h{i}.w_fc"])
    set_(block.mlp.w_proj, jnp.zeros(block.mlp.w_proj.shape))
  for name, layer in first_target.items():
    table = model.tables[name]
    set_(table, r[f"table.{name}"] if gated else rmsnorm(r["wte"]) @ r[f"h{layer}.wv"])


def _draw(key, draws):
  """{name: ("normal" or "uniform", shape, a, b)} -> {name: float32 array}: std a * N(0, 1),
  or U(a, b), each from fold_in(key, crc32(name)). Tensors of one distribution and shape
  are drawn by one vmapped call: the same values as a call each, with one random-bits
  kernel per shape, not one per tensor (init then compiles in less time than the train
  step)."""
  groups = {}
  for name, (dist, shape, a, b) in draws.items():
    groups.setdefault((dist, tuple(shape)), []).append((name, a, b))
  out = {}
  for (dist, shape), items in groups.items():
    names, a, b = zip(*items)
    ids = jnp.asarray([zlib.crc32(n.encode()) for n in names], jnp.uint32)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, ids)
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if dist == "normal":
      x = jax.vmap(lambda k, std, _: std * jax.random.normal(k, shape, jnp.float32))(keys, a, b)
    else:
      x = jax.vmap(lambda k, lo, hi: jax.random.uniform(k, shape, jnp.float32, lo, hi))(
          keys, a, b)
    out.update((n, x[j]) for j, n in enumerate(names))
  return out


def init(spec: ModelSpec, key, shardings=None) -> GPT:
  """An initialised model, built inside one jit so no tensor exists twice; with
  `shardings` (a pure dict like the parameters) every parameter is created sharded."""
  graphdef = nnx.graphdef(model_lib.abstract(spec))

  def make(k):
    model = GPT(spec)
    init_weights(model, k)
    return nnx.to_pure_dict(nnx.state(model))

  return nnx.merge(graphdef, jax.jit(make, out_shardings=shardings)(key))
