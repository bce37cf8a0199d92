"""The GPT model of the paper (Section 3, the reference's gpt.py) with every value mode.

Shapes are suffixed: B batch, T query positions, S key positions, D model width,
H query heads, K kv heads, G = H / K query heads per kv head, E head dim,
V (padded) vocabulary, F MLP width.

One forward serves training, prefill and decoding: `Block.__call__` takes an
optional decoding cache (kvcache.py), and `GPT.__call__` with a cache runs the new
tokens against it. Parameters carry logical axis names (`logical=`); sharding.py
maps them to mesh axes. Modules create zero-filled parameters; `init_weights` is
the whole initialisation in one function, as in nanochat, and `init` the one way
to build an initialised model.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax import config as config_lib
from bov_jax import kvcache
from bov_jax import sharding
from bov_jax import values
from bov_jax.kernels import attention
from bov_jax.kernels import loss as loss_lib
from bov_jax.kernels.matmul import mm
from bov_jax.spec import ModelSpec

SMEAR_CHANNELS = 24
QK_NORM_SCALE = 1.2
ROPE_BASE = 100000.0


def rmsnorm(x):
  """Parameter-free RMSNorm, eps = machine epsilon of x's dtype (torch's default)."""
  eps = jnp.finfo(x.dtype).eps
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rope(pos_BT, E):
  """cos and sin [B, T, 1, E/2] of the rotary embedding at these positions, computed
  once per forward pass. Numpy positions (training: 0..T-1) give numpy constants,
  which XLA folds instead of recomputing them inside every fusion that reads them."""
  xp = np if isinstance(pos_BT, np.ndarray) else jnp
  inv_freq = 1.0 / (ROPE_BASE ** (np.arange(0, E, 2, dtype=np.float32) / E))
  angle = pos_BT.astype(np.float32)[..., None] * inv_freq  # [B, T, E/2]
  return xp.cos(angle)[:, :, None, :], xp.sin(angle)[:, :, None, :]


def rotary(x_BTNE, cos_sin):
  """Half-split rotary embedding: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos."""
  E = x_BTNE.shape[-1]
  cos, sin = (c.astype(x_BTNE.dtype) for c in cos_sin)
  x1, x2 = x_BTNE[..., : E // 2], x_BTNE[..., E // 2:]
  return jnp.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)


def _param(shape, logical, dtype):
  return nnx.Param(jnp.zeros(shape, dtype), logical=logical)


class Attention(nnx.Module):

  def __init__(self, spec: ModelSpec, index: int):
    D, H, K, E = spec.n_embd, spec.n_head, spec.n_kv_head, spec.head_dim
    pd = jnp.dtype(spec.param_dtype)
    self.index = index
    self.lv = spec.layers[index]
    self.window = spec.windows[index]
    self.kernel = spec.attention
    self.decode_kernel = spec.decode_attention
    self.table_lookup = spec.table_lookup
    self.n_head, self.n_kv_head, self.head_dim = H, K, E
    self.wq = _param((D, H * E), ("embed", "q_heads"), pd)
    self.wk = _param((D, K * E), ("embed", "kv_heads"), pd)
    self.wv = _param((D, K * E), ("embed", "kv_heads"), pd) if self.lv.computes_v else None
    self.wo = _param((H * E, D), ("q_heads", "embed"), pd)
    self.coeffs = nnx.Dict({name: _param((), (), pd) for name in self.lv.coeff_names})
    self.gate = (_param((values.GATE_CHANNELS, K), (None, None), pd)
                 if self.lv.has_gate else None)

  def project_v(self, x_BTD):
    B, T, _ = x_BTD.shape
    return mm(x_BTD, self.wv[...]).reshape(B, T, self.n_kv_head, self.head_dim)

  def qkv(self, x_BTD, rope_cs, v_tilde_BTKE=None):
    """Queries, keys and values of the new positions (rotary and QK-norm applied; the
    values combined as the value mode says)."""
    B, T, _ = x_BTD.shape
    H, K, E = self.n_head, self.n_kv_head, self.head_dim
    # One matmul for q, k (and v): fewer, larger matmuls run faster, and the
    # concatenated weight is small next to the activations.
    ws = [self.wq[...], self.wk[...]] + ([self.wv[...]] if self.lv.uses_v else [])
    qkv = mm(x_BTD, jnp.concatenate(ws, axis=1).astype(x_BTD.dtype))
    q = qkv[..., :H * E].reshape(B, T, H, E)
    k = qkv[..., H * E:(H + K) * E].reshape(B, T, K, E)
    v = qkv[..., (H + K) * E:].reshape(B, T, K, E) if self.lv.uses_v else None
    q = rmsnorm(rotary(q, rope_cs)) * QK_NORM_SCALE
    k = rmsnorm(rotary(k, rope_cs)) * QK_NORM_SCALE
    v = values.combine(self.lv, v, v_tilde_BTKE, self.coefficients(), gate_input=x_BTD,
                       gate_w=None if self.gate is None else self.gate[...])
    return q, k, v

  def coefficients(self) -> dict:
    return {n: p[...] for n, p in self.coeffs.items()}

  def __call__(self, x_BTD, rope_cs, v_tilde_BTKE=None, cache=None, table=None):
    """(output [B, T, D], values attended over [B, T, K, E], cache). Without a cache the
    sequence attends over itself; with one, the new positions over the cache."""
    q, k, v = self.qkv(x_BTD, rope_cs, v_tilde_BTKE)
    if cache is None:
      y = attention.self_attend(q, k, v, self.window, self.kernel)
    else:
      y, cache = kvcache.attend(self, q, k, v, cache, table)
    return mm(y, self.wo[...]), v, cache


class MLP(nnx.Module):

  def __init__(self, spec: ModelSpec):
    D = spec.n_embd
    pd = jnp.dtype(spec.param_dtype)
    self.w_fc = _param((D, 4 * D), ("embed", "mlp"), pd)
    self.w_proj = _param((4 * D, D), ("mlp", "embed"), pd)

  def __call__(self, x_BTD):
    h = jnp.square(jax.nn.relu(mm(x_BTD, self.w_fc[...])))
    return mm(h, self.w_proj[...])


class Block(nnx.Module):

  def __init__(self, spec: ModelSpec, index: int):
    self.attn = Attention(spec, index)
    self.mlp = MLP(spec)

  def __call__(self, x_BTD, rope_cs, v_tilde_BTKE=None, cache=None, table=None):
    """(new residual stream, the layer's values, cache)."""
    a, v, cache = self.attn(rmsnorm(x_BTD), rope_cs, v_tilde_BTKE, cache, table)
    x = x_BTD + a
    return x + self.mlp(rmsnorm(x)), v, cache


class GPT(nnx.Module):

  def __init__(self, spec: ModelSpec):
    self.spec = spec  # static (hashable): part of the graphdef, so it keys jit caches
    self.compute_dtype = jnp.dtype(spec.dtype)
    Vp, D = spec.padded_vocab, spec.n_embd
    pd, ed = jnp.dtype(spec.param_dtype), jnp.dtype(spec.embedding_dtype)
    self.table_of = _FrozenDict(values.table_keys(spec.value, spec.n_layer))  # layer -> table
    self.wte = _param((Vp, D), ("vocab", "embed"), ed)
    self.lm_head = _param((D, Vp), ("embed", "vocab"), pd)
    self.smear_w = _param((SMEAR_CHANNELS,), (None,), pd)
    self.smear_lambda = _param((), (), pd)
    self.blocks = nnx.List([Block(spec, i) for i in range(spec.n_layer)])
    self.tables = nnx.Dict({name: _param((Vp, spec.n_kv_head * spec.head_dim),
                                         ("table_vocab", "kv_heads"), ed)
                            for name in sorted(set(self.table_of.values()))})

  # -- forward ---------------------------------------------------------------

  def embed(self, idx_BT, prev_BD=None):
    """Token embedding, RMSNorm and smear. Returns (x0, pre-smear x of the last position).

    prev_BD is the pre-smear embedding of the token before idx[:, 0] (decoding);
    without it position 0 is left unchanged.
    """
    x = rmsnorm(self.wte[...].astype(self.compute_dtype)[idx_BT])
    if prev_BD is None:
      prev = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
      has_prev = (jnp.arange(x.shape[1]) >= 1)[None, :, None]
    else:
      prev = jnp.concatenate([prev_BD[:, None].astype(x.dtype), x[:, :-1]], axis=1)
      has_prev = True
    gate = self.smear_lambda[...].astype(x.dtype) * jax.nn.sigmoid(
        x[..., :SMEAR_CHANNELS] @ self.smear_w[...].astype(x.dtype))
    x0 = x + jnp.where(has_prev, gate[..., None] * prev, 0)
    return x0, x[:, -1]

  def table(self, i):
    """Layer i's value table [V, K * E], or None."""
    return self.tables[self.table_of[i]][...] if i in self.table_of else None

  def v_tilde(self, i, x0n_BTD, v1_BTKE, idx_BT):
    """The context-free value V~ of target layer i."""
    lv = self.blocks[i].attn.lv
    if not lv.target or lv.source == "residual":
      return None
    if lv.source == "x0":
      return self.blocks[i].attn.project_v(x0n_BTD)
    if lv.source == "v1":
      return v1_BTKE
    B, T = idx_BT.shape
    rows = sharding.table_lookup(self.table(i), idx_BT, self.spec.table_lookup)
    return rows.astype(self.compute_dtype).reshape(B, T, self.spec.n_kv_head, self.spec.head_dim)

  def hidden(self, idx_BT, cache=None):
    """Final normed hidden states [B, T, D] in the compute dtype; with a cache, the new
    tokens run at positions pos..pos+T-1 against it and the new cache comes back too."""
    B, T = idx_BT.shape
    if cache is None:
      pos, prev = np.arange(T)[None], None
    else:
      cache, pos, prev = kvcache.begin(cache, idx_BT)
    x, last_pre = self.embed(idx_BT, prev)
    x0n = rmsnorm(x)
    cs = rope(pos, self.spec.head_dim)
    policy = config_lib.REMAT_POLICIES[self.spec.remat]
    v1 = None
    for i, block in enumerate(self.blocks):
      vt = self.v_tilde(i, x0n, v1, idx_BT)
      if cache is None and self.spec.remat != "none":
        layer = jax.checkpoint(lambda x, vt, block=block: block(x, cs, vt)[:2],
                               policy=getattr(jax.checkpoint_policies, policy))
        x, v = layer(x, vt)
      else:
        x, v, cache = block(x, cs, vt, cache, self.table(i))
      if i == 0:
        v1 = v
    if cache is None:
      return rmsnorm(x)
    return rmsnorm(x), kvcache.end(cache, last_pre, T)

  def logits(self, h_BTD):
    """fp32 soft-capped logits over the real vocabulary."""
    z = (h_BTD @ self.lm_head[...].astype(h_BTD.dtype))[..., : self.spec.vocab_size]
    z = z.astype(jnp.float32)
    return loss_lib.SOFTCAP * jnp.tanh(z / loss_lib.SOFTCAP)

  def __call__(self, idx_BT, cache=None):
    """Logits [B, T, V] (fp32); with a cache, (logits, new cache)."""
    if cache is None:
      return self.logits(self.hidden(idx_BT))
    h, cache = self.hidden(idx_BT, cache)
    return self.logits(h), cache

  def token_losses(self, idx_BT, targets_BT):
    """Cross-entropy in nats per target position; 0 where target == -1. Chunked over
    rows (kernels/loss.py): the fp32 logits of the whole batch never exist."""
    h = self.hidden(idx_BT)
    B, T, D = h.shape
    nll = loss_lib.softcap_nll(h.reshape(B * T, D), self.lm_head[...], targets_BT.reshape(-1),
                               self.spec.vocab_size, self.spec.loss_chunk)
    return nll.reshape(B, T)

  def loss(self, idx_BT, targets_BT):
    """Mean cross-entropy over targets != -1 (its LM-head gradient is hand-written,
    kernels/loss.softcap_nll_sum)."""
    h = self.hidden(idx_BT)
    B, T, D = h.shape
    total = loss_lib.softcap_nll_sum(h.reshape(B * T, D), self.lm_head[...],
                                     targets_BT.reshape(-1), self.spec.vocab_size,
                                     self.spec.loss_chunk)
    return total / jnp.maximum(jnp.sum(targets_BT >= 0), 1)


class _FrozenDict(dict):
  """A dict that hashes, for static model attributes."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))


# -- initialisation ----------------------------------------------------------

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
  are drawn by one vmapped call: the same values as a call each, but XLA compiles one
  random-bits kernel per shape instead of one per tensor (which made init compile for
  longer than the train step)."""
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


def abstract(spec: ModelSpec) -> GPT:
  """The model's structure and shapes, nothing allocated."""
  return nnx.eval_shape(lambda: GPT(spec))


def init(spec: ModelSpec, key, shardings=None) -> GPT:
  """An initialised model, built inside one jit so no tensor exists twice; with
  `shardings` (a pure dict like the parameters) every parameter is created sharded."""
  graphdef = nnx.graphdef(abstract(spec))

  def make(k):
    model = GPT(spec)
    init_weights(model, k)
    return nnx.to_pure_dict(nnx.state(model))

  return nnx.merge(graphdef, jax.jit(make, out_shardings=shardings)(key))
