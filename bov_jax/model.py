"""The GPT model of the paper (SPEC section 1) with every value mode (section 2).

Shapes are suffixed: B batch, T query positions, S key positions, D model width,
H query heads, K kv heads, G = H / K query heads per kv head, E head dim,
V (padded) vocabulary, F MLP width.

Parameters carry logical axis names (`logical=`); sharding.py maps them to mesh
axes. Modules create zero-filled parameters; `init_weights` is the whole
initialisation in one function, as in nanochat.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax import attention
from bov_jax import config as config_lib
from bov_jax import losses
from bov_jax import sharding
from bov_jax import values

SMEAR_CHANNELS = 24
QK_NORM_SCALE = 1.2
ROPE_BASE = 100000.0
SOFTCAP = 15.0
# model.remat: what a layer keeps for its backward; the rest is recomputed.
REMAT = {
    "full": None,  # only the layer's inputs
    "dots": jax.checkpoint_policies.dots_saveable,  # every matmul output
    # projections, but not the attention scores/probabilities ([B, N, T, S] each)
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def rmsnorm(x):
  """Parameter-free RMSNorm, eps = machine epsilon of x's dtype (torch's default)."""
  eps = jnp.finfo(x.dtype).eps
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rope(pos_BT, E):
  """cos and sin [B, T, 1, E/2] of the rotary embedding at these positions.

  Computed once per forward pass, outside the layers. Given numpy positions
  (training: 0..T-1) they are numpy constants: as traced values XLA's CPU
  backend recomputed the cos/sin inside every fusion that read them, a third
  of the rotary/QK-norm backward.
  """
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


class _FrozenDict(dict):
  """A dict that hashes, for static model attributes."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))


def mm(x, w):
  """x [..., D] @ w [D, F] as one 2-D matmul: XLA's CPU backward (x^T dy) runs ~12%
  faster on a flattened [rows, D] operand than on a [B, T, D] one."""
  x2 = x.reshape(-1, x.shape[-1])
  w = w.astype(x.dtype)
  y = _mm_narrowing(x2, w) if _narrowing_on_cpu(w) else x2 @ w
  return y.reshape(*x.shape[:-1], w.shape[-1])


def _narrowing_on_cpu(w):
  return w.shape[0] > w.shape[1] and jax.default_backend() == "cpu"


@jax.custom_vjp
def _mm_narrowing(x, w):
  """x @ w for a w with more rows than columns (the MLP's W_proj), whose weight
  gradient is formed transposed: XLA's CPU matmul writes x^T dy [4D, D] at ~110
  GFLOP/s and dy^T x [D, 4D] at ~150; the barrier keeps XLA from folding the
  transpose back into the matmul (~2% of the train step)."""
  return x @ w


def _mm_narrowing_fwd(x, w):
  return x @ w, (x, w)


def _mm_narrowing_bwd(res, dy):
  x, w = res
  return dy @ w.T, jax.lax.optimization_barrier(dy.T @ x).T


_mm_narrowing.defvjp(_mm_narrowing_fwd, _mm_narrowing_bwd)


def _param(shape, logical, dtype):
  return nnx.Param(jnp.zeros(shape, dtype), logical=logical)


class Attention(nnx.Module):

  def __init__(self, cfg, lv: values.LayerValue, window: int):
    m = cfg.model
    D, H, K = m.n_embd, m.n_head, m.n_kv_head
    E = D // H
    pd = jnp.dtype(m.param_dtype)
    self.lv = lv
    self.window = window
    self.n_head, self.n_kv_head, self.head_dim = H, K, E
    self.wq = _param((D, H * E), ("embed", "q_heads"), pd)
    self.wk = _param((D, K * E), ("embed", "kv_heads"), pd)
    self.wv = _param((D, K * E), ("embed", "kv_heads"), pd) if lv.has_wv else None
    self.wo = _param((H * E, D), ("q_heads", "embed"), pd)
    self.coeffs = nnx.Dict({name: _param((), (), pd) for name in lv.coeff_names})
    self.gate = (_param((values.GATE_CHANNELS, K), (None, None), pd)
                 if lv.has_gate else None)

  def project_v(self, x_BTD):
    B, T, _ = x_BTD.shape
    return mm(x_BTD, self.wv[...]).reshape(B, T, self.n_kv_head, self.head_dim)

  def qkv(self, x_BTD, rope_cs, v_tilde_BTKE=None):
    """Queries, keys and values of the new positions (rotary and QK-norm applied).

    rope_cs: (cos, sin) of the positions, from `rope`."""
    B, T, _ = x_BTD.shape
    H, K, E = self.n_head, self.n_kv_head, self.head_dim
    dt = x_BTD.dtype
    # One matmul for q, k (and v): fewer, larger matmuls run faster, and the
    # concatenated weight is small next to the activations.
    ws = [self.wq[...], self.wk[...]] + ([self.wv[...]] if self.lv.uses_v else [])
    qkv = mm(x_BTD, jnp.concatenate(ws, axis=1).astype(dt))
    q = qkv[..., :H * E].reshape(B, T, H, E)
    k = qkv[..., H * E:(H + K) * E].reshape(B, T, K, E)
    v = qkv[..., (H + K) * E:].reshape(B, T, K, E) if self.lv.uses_v else None
    q = rmsnorm(rotary(q, rope_cs)) * QK_NORM_SCALE
    k = rmsnorm(rotary(k, rope_cs)) * QK_NORM_SCALE
    coeffs = {n: p[...] for n, p in self.coeffs.items()}
    v = values.combine(self.lv, v, v_tilde_BTKE, coeffs, gate_input=x_BTD,
                       gate_w=None if self.gate is None else self.gate[...])
    return q, k, v

  def output(self, y_BTF):
    return mm(y_BTF, self.wo[...])


class MLP(nnx.Module):

  def __init__(self, cfg):
    D = cfg.model.n_embd
    pd = jnp.dtype(cfg.model.param_dtype)
    self.w_fc = _param((D, 4 * D), ("embed", "mlp"), pd)
    self.w_proj = _param((4 * D, D), ("mlp", "embed"), pd)

  def __call__(self, x_BTD):
    h = jnp.square(jax.nn.relu(mm(x_BTD, self.w_fc[...])))
    return mm(h, self.w_proj[...])


class Block(nnx.Module):

  def __init__(self, cfg, lv, window):
    self.attn = Attention(cfg, lv, window)
    self.mlp = MLP(cfg)


class GPT(nnx.Module):

  def __init__(self, cfg):
    mode = config_lib.validate(cfg)
    m = cfg.model
    self.mode = mode
    self.vocab_size = m.vocab_size
    self.compute_dtype = jnp.dtype(m.dtype)
    self.table_lookup = m.table_lookup
    self.remat = m.remat
    self.attention_impl = m.attention
    self.decode_attention = m.get("decode_attention", "auto")
    self.loss_chunk = m.loss_chunk or (256 if jax.default_backend() == "cpu" else 2048)
    Vp = values.padded_vocab(m.vocab_size)
    D = m.n_embd
    K, E = m.n_kv_head, m.n_embd // m.n_head
    pd = jnp.dtype(m.param_dtype)
    # static (hashable, so the graphdef can key a jit cache)
    self.plan = tuple(values.layer_plan(mode, m.n_layer))
    self.table_of = _FrozenDict(values.table_keys(mode, m.n_layer))  # layer -> table name
    self.wte = _param((Vp, D), ("vocab", "embed"), pd)
    self.lm_head = _param((D, Vp), ("embed", "vocab"), pd)
    self.smear_w = _param((SMEAR_CHANNELS,), (None,), pd)
    self.smear_lambda = _param((), (), pd)
    windows = config_lib.window_sizes(cfg)
    self.blocks = nnx.List([Block(cfg, lv, w) for lv, w in zip(self.plan, windows)])
    self.tables = nnx.Dict({name: _param((Vp, K * E), ("table_vocab", "kv_heads"), pd)
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

  def v_tilde(self, i, x0n_BTD, v1_BTKE, idx_BT):
    """The context-free value V~ of target layer i."""
    lv = self.plan[i]
    if not lv.target or lv.source == "residual":
      return None
    if lv.source == "x0":
      return self.blocks[i].attn.project_v(x0n_BTD)
    if lv.source == "v1":
      return v1_BTKE
    attn = self.blocks[i].attn
    B, T = idx_BT.shape
    rows = sharding.table_lookup(self.tables[self.table_of[i]][...], idx_BT, self.table_lookup)
    return rows.astype(self.compute_dtype).reshape(B, T, attn.n_kv_head, attn.head_dim)

  def hidden(self, idx_BT, return_kv: bool = False):
    """Final normed hidden states [B, T, D] in the compute dtype.

    With return_kv, also each layer's (keys, values) [B, T, K, E], the values
    being the ones attended over (after the value mode's combination).
    """
    B, T = idx_BT.shape
    cs = rope(np.arange(T)[None], self.blocks[0].attn.head_dim)
    x, _ = self.embed(idx_BT)
    x0n = rmsnorm(x)
    v1 = None
    kvs = []
    for i, block in enumerate(self.blocks):

      def layer(x, v_tilde, block=block):
        q, k, v = block.attn.qkv(rmsnorm(x), cs, v_tilde)
        y = attention.self_attend(q, k, v, block.attn.window, self.attention_impl)
        x = x + block.attn.output(y)
        return x + block.mlp(rmsnorm(x)), (k, v)

      if self.remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT[self.remat])
      x, (k, v) = layer(x, self.v_tilde(i, x0n, v1, idx_BT))
      if i == 0:
        v1 = v
      if return_kv:
        kvs.append((k, v))
    return (rmsnorm(x), kvs) if return_kv else rmsnorm(x)

  def logits(self, h_BTD):
    """fp32 soft-capped logits over the real vocabulary."""
    z = (h_BTD @ self.lm_head.astype(h_BTD.dtype))[..., : self.vocab_size]
    z = z.astype(jnp.float32)
    return SOFTCAP * jnp.tanh(z / SOFTCAP)

  def __call__(self, idx_BT):
    return self.logits(self.hidden(idx_BT))

  def token_losses(self, idx_BT, targets_BT):
    """Cross-entropy in nats per target position; 0 where target == -1.

    Chunked over rows (losses.py): the fp32 logits of the whole batch are never
    materialised.
    """
    h = self.hidden(idx_BT)
    B, T, D = h.shape
    nll = losses.softcap_nll(h.reshape(B * T, D), self.lm_head[...], targets_BT.reshape(-1),
                             self.vocab_size, self.loss_chunk)
    return nll.reshape(B, T)

  def loss(self, idx_BT, targets_BT):
    """Mean cross-entropy over targets != -1 (its LM-head gradient is hand-written,
    losses.softcap_nll_sum)."""
    h = self.hidden(idx_BT)
    B, T, D = h.shape
    total = losses.softcap_nll_sum(h.reshape(B * T, D), self.lm_head[...],
                                   targets_BT.reshape(-1), self.vocab_size, self.loss_chunk)
    return total / jnp.maximum(jnp.sum(targets_BT >= 0), 1)


# -- initialisation ----------------------------------------------------------

def init_weights(model: GPT, key) -> None:
  """The whole initialisation (SPEC section 1), in place.

  Every tensor draws from its own key, folded from its name, so two value modes
  built from the same seed share every weight they have in common (this is what
  makes BoV at init equal x0-replace at init).
  """
  D = model.wte.shape[1]
  s = np.sqrt(3.0) / np.sqrt(D)

  def k(name):
    return jax.random.fold_in(key, zlib.crc32(name.encode()))

  def normal(name, shape, std, dtype):
    return (std * jax.random.normal(k(name), shape, jnp.float32)).astype(dtype)

  def uniform(name, shape, lo, hi, dtype):
    return jax.random.uniform(k(name), shape, jnp.float32, lo, hi).astype(dtype)

  def set_(p, value):
    p.set_value(value.astype(p.dtype))

  set_(model.wte, normal("wte", model.wte.shape, 0.8, jnp.float32))
  set_(model.lm_head, normal("lm_head", model.lm_head.shape, 0.001, jnp.float32))
  set_(model.smear_lambda, jnp.zeros(()))
  set_(model.smear_w, uniform("smear_w", model.smear_w.shape, 0.0, 0.02, jnp.float32))
  wv_init = {}
  for i, block in enumerate(model.blocks):
    a = block.attn
    set_(a.wq, uniform(f"h{i}.wq", a.wq.shape, -s, s, jnp.float32))
    set_(a.wk, uniform(f"h{i}.wk", a.wk.shape, -s, s, jnp.float32))
    # Every layer draws its W_v, owned or not: a table is initialised from it.
    wv_init[i] = uniform(f"h{i}.wv", (D, a.n_kv_head * a.head_dim), -s, s, jnp.float32)
    if a.wv is not None:
      set_(a.wv, wv_init[i])
    set_(a.wo, jnp.zeros(a.wo.shape))
    for name, p in a.coeffs.items():
      set_(p, jnp.asarray(0.0 if name == "beta" else 1.0))
    if a.gate is not None:
      set_(a.gate, uniform(f"h{i}.gate", a.gate.shape, 0.0, 0.02, jnp.float32))
    set_(block.mlp.w_fc, uniform(f"h{i}.w_fc", block.mlp.w_fc.shape, -0.4 * s, 0.4 * s,
                                 jnp.float32))
    set_(block.mlp.w_proj, jnp.zeros(block.mlp.w_proj.shape))
  # Value tables: aligned init E_l[t] = rmsnorm(wte[t]) @ W_v,l in fp32, so the first
  # forward pass equals x0-replace; a shared table uses the first target's W_v.
  # The gated variant draws U(-s, s) instead.
  first_target = {}
  for layer, name in sorted(model.table_of.items()):
    first_target.setdefault(name, layer)
  gated = model.mode.combine == "gated_add"
  for name, layer in first_target.items():
    table = model.tables[name]
    if gated:
      set_(table, uniform(f"table.{name}", table.shape, -s, s, jnp.float32))
    else:
      set_(table, rmsnorm(model.wte[...].astype(jnp.float32)) @ wv_init[layer])


def describe(cfg) -> str:
  m = cfg.model
  mode = config_lib.value_mode(cfg)
  name = mode.preset or f"{mode.source}/{mode.combine}/{mode.coeff}/{mode.layers}"
  return (f"{m.n_layer}L d{m.n_embd} H{m.n_head}/{m.n_kv_head} T{m.sequence_len} "
          f"V{m.vocab_size} {name}")


def build(cfg) -> GPT:
  """An un-initialised (zero) model; cheap under nnx.eval_shape."""
  return GPT(cfg)


def init_model_eager(cfg, key) -> GPT:
  """Builds and initialises a model (call under jit to avoid materialising zeros)."""
  model = GPT(cfg)
  init_weights(model, key)
  return model


def init_model(cfg, key=None, out_shardings=None) -> GPT:
  """Builds and initialises the model inside one jit, so no tensor exists twice
  and (with out_shardings) every parameter is created already sharded."""
  if key is None:
    key = jax.random.key(cfg.train.seed)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg)))
  state = jax.jit(lambda k: nnx.state(init_model_eager(cfg, k)),
                  out_shardings=out_shardings)(key)
  return nnx.merge(graphdef, state)
