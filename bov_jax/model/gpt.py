"""The GPT model of the paper (Section 3, the reference's gpt.py) with every value mode.

Shapes are suffixed: B batch, T query positions, S key positions, D model width,
H query heads, K kv heads, G = H / K query heads per kv head, E head dim,
V (padded) vocabulary, F MLP width.

One forward serves training, prefill and decoding: `Block.__call__` takes an
optional decoding cache (kvcache.py), and `GPT.__call__` with a cache runs the new
tokens against it. Parameters carry logical axis names (`logical=`); sharding.py
maps them to mesh axes. Layers run as stages (spec.Stage): a block of layers that
repeats runs under one `lax.scan`, so compile time does not grow with depth.
Modules create zero-filled parameters; `initialize.init_weights` is the whole
initialisation in one function, as in nanochat, and `initialize.init` the one way to
build an initialised model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.kernels import attention
from bov_jax.kernels.matmul import mm
from bov_jax.model import combine
from bov_jax.model import kvcache
from bov_jax.model import loss as loss_lib
from bov_jax.parallel import lookup
from bov_jax.parallel import rowsum
from bov_jax.parallel import sharding
from bov_jax.settings import config as config_lib
from bov_jax.settings import values
from bov_jax.settings.model_spec import ModelSpec

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
    self.layer_value = spec.layers[index]
    self.window = spec.windows[index]
    self.spec = spec  # static: the kernels' resolved settings
    self.n_head, self.n_kv_head, self.head_dim = H, K, E
    self.wq = _param((D, H * E), ("embed", "q_heads"), pd)
    self.wk = _param((D, K * E), ("embed", "kv_heads"), pd)
    self.wv = _param((D, K * E), ("embed", "kv_heads"), pd) if self.layer_value.computes_v else None
    self.wo = _param((H * E, D), ("q_heads", "embed"), pd)
    self.coeffs = nnx.Dict({name: _param((), (), pd) for name in self.layer_value.coeff_names})
    self.gate = (_param((values.GATE_CHANNELS, K), (None, None), pd)
                 if self.layer_value.has_gate else None)

  def project_v(self, x_BTD):
    B, T, _ = x_BTD.shape
    return mm(x_BTD, self.wv[...], self.spec.matmul).reshape(B, T, self.n_kv_head, self.head_dim)

  def qkv(self, x_BTD, rope_cs, v_tilde_BTKE=None):
    """Queries, keys and values of the new positions (rotary and QK-norm applied; the
    values combined as the value mode says)."""
    B, T, _ = x_BTD.shape
    H, K, E = self.n_head, self.n_kv_head, self.head_dim
    # One matmul for q, k (and v): fewer, larger matmuls run faster, and the
    # concatenated weight is small next to the activations.
    ws = [self.wq[...], self.wk[...]] + ([self.wv[...]] if self.layer_value.uses_v else [])
    qkv = mm(x_BTD, jnp.concatenate(ws, axis=1).astype(x_BTD.dtype), self.spec.matmul)
    q = qkv[..., :H * E].reshape(B, T, H, E)
    k = qkv[..., H * E:(H + K) * E].reshape(B, T, K, E)
    v = qkv[..., (H + K) * E:].reshape(B, T, K, E) if self.layer_value.uses_v else None
    q = rmsnorm(rotary(q, rope_cs)) * QK_NORM_SCALE
    k = rmsnorm(rotary(k, rope_cs)) * QK_NORM_SCALE
    v = combine.combine(self.layer_value, v, v_tilde_BTKE, self.coefficients(), gate_input=x_BTD,
                       gate_w=None if self.gate is None else self.gate[...])
    return q, k, v

  def coefficients(self) -> dict:
    return {n: p[...] for n, p in self.coeffs.items()}

  def __call__(self, x_BTD, rope_cs, v_tilde_BTKE=None, cache=None, table=None):
    """(output [B, T, D], values attended over [B, T, K, E], cache). Without a cache the
    sequence attends over itself; with one (a `kvcache.LayerCache`), the new positions
    over it, and the updated cache comes back."""
    q, k, v = self.qkv(x_BTD, rope_cs, v_tilde_BTKE)
    s = self.spec
    if cache is None:
      y = attention.self_attend(q, k, v, self.window, s.attention,
                                interpret=s.splash_interpret, block=s.attention_block)
    else:
      y, cache = kvcache.attend(kvcache.layer_settings(s, self.layer_value, self.window), q, k, v,
                                cache, table, self.coefficients())
    return mm(y, self.wo[...], s.matmul), v, cache


class MLP(nnx.Module):

  def __init__(self, spec: ModelSpec):
    D = spec.n_embd
    pd = jnp.dtype(spec.param_dtype)
    self.matmul = spec.matmul
    self.w_fc = _param((D, 4 * D), ("embed", "mlp"), pd)
    self.w_proj = _param((4 * D, D), ("mlp", "embed"), pd)

  def __call__(self, x_BTD):
    h = jnp.square(jax.nn.relu(mm(x_BTD, self.w_fc[...], self.matmul)))
    return mm(h, self.w_proj[...], self.matmul)


class Block(nnx.Module):

  def __init__(self, spec: ModelSpec, index: int):
    self.attn = Attention(spec, index)
    self.mlp = MLP(spec)

  def __call__(self, x_BTD, rope_cs, v_tilde_BTKE=None, cache=None, table=None):
    """(new residual stream, the layer's values, cache)."""
    a, v, cache = self.attn(rmsnorm(x_BTD), rope_cs, v_tilde_BTKE, cache, table)
    x = x_BTD + a
    return x + self.mlp(rmsnorm(x)), v, cache


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


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
    # Parameters are kept per layer (checkpoints, the optimizer, convert and report see
    # layer i as blocks/i); a scanned stage stacks its layers' weights as it runs them.
    self.blocks = nnx.List([Block(spec, i) for i in range(spec.n_layer)])
    self.tables = nnx.Dict({name: _param((Vp, spec.n_kv_head * spec.head_dim),
                                         ("table_vocab", "table_width"), ed)
                            for name in sorted(set(self.table_of.values()))})

  # -- forward ---------------------------------------------------------------

  def embed(self, idx_BT, prev_BD=None):
    """Token embedding, RMSNorm and smear. Returns (x0, pre-smear x of the last position).

    prev_BD is the pre-smear embedding of the token before idx[:, 0] (decoding);
    without it position 0 is left unchanged.
    """
    x = rmsnorm(lookup.embedding_lookup(self.wte[...].astype(self.compute_dtype), idx_BT))
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

  def v_tilde(self, attn, x0n_BTD, v1_BTKE, idx_BT, table):
    """The context-free value V~ of a target layer (`attn` its attention, `table` its
    value table)."""
    layer_value = attn.layer_value
    if not layer_value.target or layer_value.source == "residual":
      return None
    if layer_value.source == "x0":
      return attn.project_v(x0n_BTD)
    if layer_value.source == "v1":
      return v1_BTKE
    B, T = idx_BT.shape
    rows = lookup.table_lookup(table, idx_BT, self.spec.table_lookup,
                                self.spec.tables_on_host)
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
    x = sharding.constrain(x, ("batch", None, None))
    x0n = rmsnorm(x)
    ctx = _Inputs(rope(pos, self.spec.head_dim), x0n, idx_BT, cache)
    stages = []
    for n, stage in enumerate(self.spec.stages):
      x, stage_cache, v = self._stage(stage, x, ctx, None if cache is None else cache["layers"][n])
      stages.append(stage_cache)
      if stage.start == 0:  # layer 0's values: V1 for the V1 modes
        ctx = ctx._replace(v1=v, v1_cache=None if stage_cache is None else stage_cache[0])
    if cache is None:
      return rmsnorm(x)
    return rmsnorm(x), kvcache.end(dict(cache, layers=stages), last_pre, T)

  def _stage(self, stage, x, ctx, cache):
    """Runs a stage's layers: unrolled when it has one repeat, else one block of
    `period` layers under a lax.scan over the repeats, with its layers' weights and
    value tables stacked (a shared table is read by all as it is). Returns (x, the
    stage's cache, the first layer's values: layer 0's when the stage starts there)."""
    P, R = stage.period, stage.repeats
    graphdefs = [nnx.graphdef(self.blocks[stage.start + j]) for j in range(P)]
    weights = [_stack([nnx.state(self.blocks[i]) for i in stage.layers(j)]) for j in range(P)]
    shared = self.spec.value.shared_table
    per_repeat = [self.table(stage.start + j) is not None and not shared for j in range(P)]
    tables = [jnp.stack([self.table(i) for i in stage.layers(j)]) if per_repeat[j]
              else self.table(stage.start + j) for j in range(P)]

    def block(x, r, weights_r, tables_r, cache):
      """The P layers of repeat r (their weights, and per-repeat tables, sliced to it)."""
      cache = None if cache is None else list(cache)
      first = None
      for j in range(P):
        table = tables_r[j] if per_repeat[j] else tables[j]
        x, v, c = self._layer(graphdefs[j], weights_r[j], x, ctx, table,
                              None if cache is None else (cache[j], r))
        if cache is not None:
          cache[j] = c
        first = v if j == 0 else first
        x = sharding.constrain(x, ("batch", None, None))
      return x, cache, first

    if R == 1:
      return block(x, 0, [jax.tree.map(lambda a: a[0], w) for w in weights],
                   [t[0] if rep else None for t, rep in zip(tables, per_repeat)], cache)

    def body(carry, xs):
      x, cache = carry
      x, cache, _ = block(x, *xs, cache)
      return (x, cache), None

    xs = (jnp.arange(R), weights, [t if rep else None for t, rep in zip(tables, per_repeat)])
    (x, cache), _ = jax.lax.scan(body, (x, cache), xs)
    return x, cache, None

  def _layer(self, graphdef, weights, x, ctx, table, cache):
    """One layer (its weights a state of `graphdef`) with remat per model.remat when
    training. cache: (the stage's LayerCache for this layer's position, repeat r)."""
    def run(weights, x, table):
      block = nnx.merge(graphdef, weights)
      vt = self.v_tilde(block.attn, ctx.x0n, ctx.v1, ctx.idx, table)
      if cache is None:
        x, v, _ = block(x, ctx.rope, vt)
        return x, v, None
      entry, r = cache
      layer_cache = kvcache.LayerCache(entry, r, ctx.cache, ctx.v1_cache)
      return block(x, ctx.rope, vt, layer_cache, table)

    if cache is None and self.spec.remat != "none":
      policy = getattr(jax.checkpoint_policies, config_lib.REMAT_POLICIES[self.spec.remat])
      return jax.checkpoint(run, policy=policy)(weights, x, table)
    return run(weights, x, table)

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
    rows (model/loss.py): the fp32 logits of the whole batch never exist."""
    h = self.hidden(idx_BT)
    B, T, D = h.shape
    nll = loss_lib.softcap_nll(h.reshape(B * T, D), self.lm_head[...], targets_BT.reshape(-1),
                               self.spec.vocab_size, *self._loss_chunks(B))
    return nll.reshape(B, T)

  def loss(self, idx_BT, targets_BT):
    """Mean cross-entropy over targets != -1 (its LM-head gradient is hand-written,
    kernels/loss.softcap_nll_sum)."""
    def head_loss(h_BTD, y_BT, w_DV):
      B, T, D = h_BTD.shape
      return loss_lib.softcap_nll_sum(h_BTD.reshape(B * T, D), w_DV, y_BT.reshape(-1),
                                      self.spec.vocab_size, *self._loss_chunks(B))

    total = rowsum.sum_over_rows(head_loss, (self.hidden(idx_BT), targets_BT),
                                   (self.lm_head[...],))
    return total / jnp.maximum(jnp.sum(targets_BT >= 0), 1)

  def _loss_chunks(self, B: int) -> tuple[int, int]:
    """(rows per cross-entropy chunk, sequences): model.loss_chunk rows on each device,
    the same positions of all B sequences at once (model/loss.py)."""
    return self.spec.loss_chunk * sharding.batch_shards(B), B


class _Inputs(NamedTuple):
  """What every layer of one forward reads besides the residual stream."""
  rope: tuple
  x0n: jax.Array
  idx: jax.Array
  cache: dict | None = None     # the whole cache (positions, ids), with one
  v1: jax.Array | None = None   # layer 0's values (V1 modes)
  v1_cache: object = None       # layer 0's stage cache (V1 modes, decoding)


class _FrozenDict(dict):
  """A dict that hashes, for static model attributes."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))


# -- building --------------------------------------------------------------------

def abstract(spec: ModelSpec) -> GPT:
  """The model's structure and shapes, nothing allocated."""
  return nnx.eval_shape(lambda: GPT(spec))
