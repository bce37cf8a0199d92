"""A bov_jax model in PyTorch for Hugging Face transformers (5.x): what
`AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)` builds from a
folder bov_jax.export wrote.

The forward is bov_jax's (its model/gpt.py, the reference's gpt.py): token embedding,
RMSNorm and the smear gate; per layer, causal sliding-window GQA attention with rotary
embeddings and QK-norm, then a squared-ReLU MLP; 15 tanh(z / 15) soft-capped logits.
Every value mode of the paper (Section 4) is the config's `value_mode`, resolved per
layer by `LayerValue` as bov_jax resolves it: where the context-free value V~ comes from
(x0, layer 0's values V1, or a per-layer table looked up by token id: the Bank of
Values), and how it meets V = x W_v (replace, add, gated_add, scale; fixed or learned
coefficients). Parameters keep bov_jax's names and layouts (`blocks.3.attn.wq` is
[D, H * E], applied as x @ W), so the folder's safetensors load as they are.

Decoding keeps what bov_jax's cache keeps (the paper, Section 5): keys for every layer,
values only for layers that compute their own, and the token ids once; a bank layer's
values are gathered from its table by those ids when it runs, and a layer that replaces
its value with V1 reads layer 0's.

Every attention module dispatches through transformers' attention interface
(`ALL_ATTENTION_FUNCTIONS`, an integer `layer_idx`), so an engine that registers its own
attention there serves the folder: vLLM's Transformers backend calls the base model
(`BovGPTModel`) with every sequence's new tokens packed in one row and keeps the cache
itself. That cache holds values for every layer, bank layers included (it knows no other
kind). The smear gate reads the previous token, which a packed row does not carry: one
more attention layer (`PreviousToken`, layer index n_layer) reads it back from that cache.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_bov_gpt import BovGPTConfig


def rms_norm(x):
  """Parameter-free RMSNorm in float32, eps the machine epsilon of x's dtype."""
  xf = x.float()
  eps = torch.finfo(x.dtype).eps
  return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(x_BTNE, cos, sin):
  """Half-split rotary embedding: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos."""
  E = x_BTNE.shape[-1]
  x1, x2 = x_BTNE[..., : E // 2], x_BTNE[..., E // 2:]
  return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


def sdpa_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
  """The attention this folder computes itself ("eager" or "sdpa"): query [B, H, T, E], keys
  and values [B, K, S, E], a boolean mask [B, 1, T, S]; returns [B, T, H, E]."""
  y = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                     enable_gqa=query.shape[1] != key.shape[1])
  return y.transpose(1, 2), None


OWN_ATTENTION = (None, "eager", "sdpa")  # computed by sdpa_attention: masks of this folder's own


def packed(config) -> bool:
  """Whether an engine calls the model with its sequences' new tokens packed in one row
  and keeps the cache (vLLM's Transformers backend)."""
  return config._attn_implementation not in OWN_ATTENTION


class LayerValue:
  """What one layer does for its value vector (bov_jax's settings/values.py)."""

  def __init__(self, config, i: int):
    mode = config.value_mode
    self.target = i in set(config.value_layers)
    self.source = mode["source"] if self.target else "residual"
    self.combine = mode["combine"] if self.target else "replace"
    self.learned = self.target and mode["coeff"] == "learned"
    self.table = None
    if self.target and self.source == "table":
      self.table = "shared" if mode.get("shared_table") else f"layer_{i}"
    replaced = self.target and self.combine == "replace"
    self.computes_v = not (replaced and self.source in ("table", "v1"))  # owns W_v
    self.uses_v = not replaced or self.source == "residual"  # x W_v reaches the output
    self.coeff_names = ()
    if self.learned and self.combine in ("replace", "scale"):
      self.coeff_names = ("gamma",)
    elif self.learned and self.combine == "add":
      self.coeff_names = ("alpha", "beta")


class BovCache(DynamicCache):
  """The decoding cache: per layer keys [B, K, S, E], and values only where the layer
  computes its own (others hold an empty [B, K, S, 0]); the token ids [B, S] and their
  positions, once for the model."""

  def __init__(self):
    super().__init__()
    self.ids = self.positions = None

  def add_tokens(self, ids_BT, pos_BT):
    """Appends the new tokens; returns (all ids, all positions) [B, S]."""
    if self.ids is None:
      self.ids, self.positions = ids_BT, pos_BT
    else:
      self.ids = torch.cat([self.ids, ids_BT], dim=1)
      self.positions = torch.cat([self.positions, pos_BT], dim=1)
    return self.ids, self.positions

  def _tokens(self, op):
    if self.ids is not None:
      self.ids, self.positions = op(self.ids), op(self.positions)

  def reorder_cache(self, beam_idx):
    super().reorder_cache(beam_idx)
    self._tokens(lambda t: t.index_select(0, beam_idx.to(t.device)))

  def crop(self, tokens_to_remove: int):
    super().crop(tokens_to_remove)
    if tokens_to_remove < 0:
      self._tokens(lambda t: t[:, :tokens_to_remove])

  def batch_repeat_interleave(self, repeats: int):
    super().batch_repeat_interleave(repeats)
    self._tokens(lambda t: t.repeat_interleave(repeats, dim=0))

  def batch_select_indices(self, indices):
    super().batch_select_indices(indices)
    self._tokens(lambda t: t[indices])

  def reset(self):
    super().reset()
    self.ids = self.positions = None


def _param(*shape):
  return nn.Parameter(torch.zeros(shape))


class Attention(nn.Module):

  def __init__(self, config, i: int):
    super().__init__()
    D, H, K, E = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                  config.head_dim)
    self.i, self.lv, self.window = i, LayerValue(config, i), config.window_sizes[i]
    self.config, self.layer_idx, self.scaling = config, i, E ** -0.5  # the interface's
    self.H, self.K, self.E = H, K, E
    self.qk_scale = config.qk_norm_scale
    self.gate_channels, self.gate_scale = config.gate_channels, config.gate_scale
    self.wq, self.wk, self.wo = _param(D, H * E), _param(D, K * E), _param(H * E, D)
    if self.lv.computes_v:
      self.wv = _param(D, K * E)
    self.coeffs = nn.ParameterDict({n: _param() for n in self.lv.coeff_names})
    if self.lv.target and self.combine == "gated_add":
      self.gate = _param(config.gate_channels, K)

  @property
  def combine(self):
    return self.lv.combine

  def project_v(self, x_BTD):
    B, T, _ = x_BTD.shape
    return (x_BTD @ self.wv).view(B, T, self.K, self.E)

  def value(self, x_BTD, v_tilde_BTKE):
    """The value the layer attends over for the new positions (bov_jax's model/combine.py:
    the paper's Table 1), or None where it is read at attention time (bank, V1 replace)."""
    lv, c = self.lv, {n: p.to(x_BTD.dtype) for n, p in self.coeffs.items()}
    v = self.project_v(x_BTD) if lv.uses_v else None
    if not lv.target:
      return v
    if lv.combine == "scale":
      return c["gamma"] * v
    if lv.combine == "replace":
      return None if not lv.computes_v else (c["gamma"] * v_tilde_BTKE if lv.learned
                                            else v_tilde_BTKE)
    if lv.combine == "add":
      if lv.learned:
        return c["alpha"] * v + c["beta"] * v_tilde_BTKE
      return 0.5 * v + 0.5 * v_tilde_BTKE
    g = self.gate_scale * torch.sigmoid(x_BTD[..., :self.gate_channels] @ self.gate.to(x_BTD.dtype))
    return v + g[..., None] * v_tilde_BTKE

  def replaced_values(self, source_BSKE):
    """A replace layer's values over every position: gamma (or 1) times V~, V~ the table's
    rows of all the ids or layer 0's values."""
    if self.lv.learned:
      return self.coeffs["gamma"].to(source_BSKE.dtype) * source_BSKE
    return source_BSKE

  def forward(self, x_BTD, ctx):
    B, T, _ = x_BTD.shape
    q = (x_BTD @ self.wq).view(B, T, self.H, self.E)
    k = (x_BTD @ self.wk).view(B, T, self.K, self.E)
    q = rms_norm(rotary(q, *ctx.rope)) * self.qk_scale
    k = rms_norm(rotary(k, *ctx.rope)) * self.qk_scale
    v = self.value(x_BTD, ctx.v_tilde(self))
    if ctx.i_is_v1_source(self.i):
      ctx.v1_new = v
    if ctx.packed:  # the engine caches what it is given: a replace layer's values too
      if v is None:
        v = self.replaced_values(ctx.table_rows(self) if self.lv.source == "table"
                                 else ctx.v1_new)
      k_all, v_all, mask = k.transpose(1, 2), v.transpose(1, 2), None
    else:
      k_all, v_all, mask = self.cached(k, v, ctx)
    attention_interface = sdpa_attention
    if self.config._attn_implementation not in OWN_ATTENTION:
      attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    y, _ = attention_interface(self, q.transpose(1, 2), k_all, v_all, mask, scaling=self.scaling)
    return y.reshape(B, T, self.H * self.E) @ self.wo

  def cached(self, k_BTKE, v_BTKE, ctx):
    """(keys, values [B, K, S, E] over every position the cache holds, the mask): the new
    positions' written into the BovCache, a replace layer's values rebuilt."""
    B, T = k_BTKE.shape[:2]
    k_all = k_BTKE.transpose(1, 2)
    v_all = None if v_BTKE is None else v_BTKE.transpose(1, 2)
    if ctx.cache is not None:
      empty = k_BTKE.new_zeros(B, self.K, T, 0)
      k_all, stored = ctx.cache.update(k_all, empty if v_all is None else v_all, self.i)
      v_all = stored if v_all is not None else None
      if self.i == 0:
        ctx.v1_all = stored
    elif self.i == 0:
      ctx.v1_all = v_all
    if v_all is None:  # a replace layer: its values over every key position
      if self.lv.source == "table":
        rows = ctx.tables[self.lv.table][ctx.ids_all].to(k_BTKE.dtype)
        v_all = self.replaced_values(rows.view(B, -1, self.K, self.E).transpose(1, 2))
      else:
        v_all = self.replaced_values(ctx.v1_all)
    return k_all, v_all, ctx.mask(self.window)


class MLP(nn.Module):

  def __init__(self, config):
    super().__init__()
    D = config.hidden_size
    self.w_fc, self.w_proj = _param(D, 4 * D), _param(4 * D, D)

  def forward(self, x):
    return F.relu(x @ self.w_fc).square() @ self.w_proj


class Block(nn.Module):

  def __init__(self, config, i: int):
    super().__init__()
    self.attn, self.mlp = Attention(config, i), MLP(config)

  def forward(self, x, ctx):
    x = x + self.attn(rms_norm(x), ctx)
    return x + self.mlp(rms_norm(x))


class _Context:
  """What every layer of one forward reads besides the residual stream."""

  def __init__(self, model, ids_BT, x0n_BTD, rope, pos_q, pos_k, ids_all, key_ok, cache,
               packed_row=False):
    self.model, self.ids, self.x0n, self.rope, self.cache = model, ids_BT, x0n_BTD, rope, cache
    self.pos_q, self.pos_k, self.ids_all, self.key_ok = pos_q, pos_k, ids_all, key_ok
    self.tables, self.packed = model.tables, packed_row
    self.v1_new = self.v1_all = None
    self.v1_source = model.config.value_mode["source"] == "v1"

  def i_is_v1_source(self, i):
    return i == 0 and self.v1_source

  def table_rows(self, attn):
    """A bank layer's table rows [B, T, K, E] of the new positions' ids."""
    B, T = self.ids.shape
    return self.tables[attn.lv.table][self.ids].to(self.x0n.dtype).view(B, T, attn.K, attn.E)

  def v_tilde(self, attn):
    """The context-free value V~ of a target layer for the new positions."""
    lv = attn.lv
    if not lv.target or lv.source == "residual" or not lv.computes_v:
      return None
    if lv.source == "x0":
      return attn.project_v(self.x0n)
    if lv.source == "v1":
      return self.v1_new
    return self.table_rows(attn)

  def mask(self, window):
    """[B, 1, T, S]: query i sees key j iff j is a real token at or before i within the
    window; a padding query sees itself (its output is never read)."""
    T, S = self.pos_q.shape[1], self.pos_k.shape[1]
    qi = torch.arange(S - T, S, device=self.pos_q.device)[:, None]
    kj = torch.arange(S, device=self.pos_q.device)[None, :]
    gap = self.pos_q[:, :, None] - self.pos_k[:, None, :]
    seen = (kj <= qi) & (gap <= window) & self.key_ok[:, None, :]
    return (seen | (kj == qi))[:, None]


class PreviousToken(nn.Module):
  """Each new position's previous token id, read from an engine's own cache by one more
  attention layer (index n_layer), for the smear gate of a packed row. A query at position
  p points at p - 1 and a key names its own position, over the head's E/2 frequencies
  (geometric, pi down to pi / 2S: no two offsets alike within the context S), scaled so that
  every other position scores at least MARGIN below: softmax's weight there is exp(-60),
  nothing in float32. The value is the id in base-256 digits (exact in bfloat16 too). At
  position 0 the query sees only itself; the smear gate is off there."""

  MARGIN = 60.0

  def __init__(self, config):
    super().__init__()
    self.config, self.layer_idx = config, len(config.window_sizes)
    self.vocab = config.padded_vocab_size
    self.H, self.K, self.E = (config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim)
    S, n = config.max_position_embeddings, self.E // 2
    self.freqs = [torch.pi * (1.0 / (2 * S)) ** (f / max(n - 1, 1)) for f in range(n)]
    # in Python numbers: a model may be built on the meta device, where no tensor has values
    gap = min(sum(1 - math.cos(d * w) for w in self.freqs) for d in [-1, *range(1, S + 1)])
    self.scaling = self.MARGIN / gap

  def forward(self, ids_BT, pos_BT, dtype):
    B, T = ids_BT.shape
    w = torch.tensor(self.freqs, dtype=torch.float32, device=ids_BT.device)
    at = lambda p: torch.cat([torch.cos(p[..., None] * w), torch.sin(p[..., None] * w)], -1)  # noqa: E731
    q = at(pos_BT.float() - 1).to(dtype)[:, None].expand(B, self.H, T, self.E)
    k = at(pos_BT.float()).to(dtype)[:, None].expand(B, self.K, T, self.E)
    digits = torch.stack([ids_BT // 65536, ids_BT // 256 % 256, ids_BT % 256], -1)
    v = F.pad(digits.to(dtype), (0, self.E - 3))[:, None].expand(B, self.K, T, self.E)
    attention_interface = sdpa_attention
    if self.config._attn_implementation not in OWN_ATTENTION:
      attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    y, _ = attention_interface(self, q.contiguous(), k.contiguous(), v.contiguous(), None,
                               scaling=self.scaling)
    d = torch.nan_to_num(y.reshape(B, T, -1)[..., :3].float()).round().long()
    # in range whatever the engine's dummy runs (no cache yet) return
    return (d[..., 0] * 65536 + d[..., 1] * 256 + d[..., 2]).clamp(0, self.vocab - 1)


class BovGPTPreTrainedModel(PreTrainedModel):
  config_class = BovGPTConfig
  base_model_prefix = "model"
  supports_gradient_checkpointing = False
  _no_split_modules = ["Block"]
  _supports_attention_backend = True  # attention goes through ALL_ATTENTION_FUNCTIONS

  def _init_weights(self, module):
    """Every weight comes from the folder: none is initialised here."""


class BovGPTModel(BovGPTPreTrainedModel):
  """The model up to its last RMSNorm: hidden states [B, T, D] (AutoModel's class, what an
  engine with its own LM head runs). Parameters keep the folder's names."""

  def __init__(self, config: BovGPTConfig):
    super().__init__(config)
    Vp, D = config.padded_vocab_size, config.hidden_size
    KE = config.num_key_value_heads * config.head_dim
    self.wte = _param(Vp, D)
    self.smear_w, self.smear_lambda = _param(config.smear_channels), _param()
    self.blocks = nn.ModuleList([Block(config, i) for i in range(len(config.window_sizes))])
    names = sorted({b.attn.lv.table for b in self.blocks if b.attn.lv.table})
    self.tables = nn.ParameterDict({n: _param(Vp, KE) for n in names})
    # named by its layer index (previous.<n_layer>): engines read a layer's index off its name
    self.previous = nn.ModuleDict({str(len(config.window_sizes)): PreviousToken(config)})
    self.post_init()

  def get_input_embeddings(self):
    return None  # the embedding is a raw parameter (bov_jax's layout), not an nn.Embedding

  def _embed(self, ids_BT, prev_BTD, has_prev_BT):
    """Token embedding, RMSNorm and smear: x + lambda sigmoid(x[:24] w) x_prev, x_prev the
    previous token's normed embedding (none at position 0)."""
    x = rms_norm(self.wte[ids_BT])
    c = self.config.smear_channels
    gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(x[..., :c] @ self.smear_w.to(x.dtype))
    return x + torch.where(has_prev_BT[..., None], gate[..., None] * prev_BTD, 0)

  def _rope(self, pos_BT, dtype):
    E = self.config.head_dim
    inv_freq = 1.0 / (self.config.rope_theta ** (
        torch.arange(0, E, 2, dtype=torch.float32, device=pos_BT.device) / E))
    angle = pos_BT.float()[..., None] * inv_freq
    return angle.cos()[:, :, None, :].to(dtype), angle.sin()[:, :, None, :].to(dtype)

  def hidden(self, input_ids, attention_mask=None, position_ids=None, cache=None):
    """The last RMSNorm's output [B, T, D]; the BovCache (or None) updated. A 2D
    attention_mask (left padding) marks the real tokens; positions count only those. An
    engine's packed row (vLLM's Transformers backend) has its positions and keeps its cache."""
    B, T = input_ids.shape
    dtype = self.wte.dtype
    if packed(self.config):
      (previous,) = self.previous.values()
      prev = rms_norm(self.wte[previous(input_ids, position_ids, dtype)])
      x = self._embed(input_ids, prev, position_ids >= 1)
      ctx = _Context(self, input_ids, rms_norm(x), self._rope(position_ids, x.dtype),
                     position_ids, position_ids, input_ids, None, None, packed_row=True)
    else:
      past = 0 if cache is None or cache.ids is None else cache.ids.shape[1]
      dev = input_ids.device
      if attention_mask is None:
        key_ok = torch.ones(B, past + T, dtype=torch.bool, device=dev)
      else:
        key_ok = attention_mask[:, -(past + T):].bool()
      if position_ids is None:
        position_ids = (key_ok.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
      x = rms_norm(self.wte[input_ids])
      first = x[:, :1] * 0 if past == 0 else rms_norm(self.wte[cache.ids[:, -1]])[:, None]
      x = self._embed(input_ids, torch.cat([first, x[:, :-1]], dim=1), position_ids >= 1)
      pos_k, ids_all = position_ids, input_ids
      if cache is not None:
        ids_all, pos_k = cache.add_tokens(input_ids, position_ids)
      ctx = _Context(self, input_ids, rms_norm(x), self._rope(position_ids, x.dtype),
                     position_ids, pos_k, ids_all, key_ok, cache)
    for block in self.blocks:
      x = block(x, ctx)
    return rms_norm(x)

  def _cache_for(self, cache, use_cache):
    use_cache = self.config.use_cache if use_cache is None else use_cache
    if packed(self.config):
      return None, False
    if cache is not None and not isinstance(cache, BovCache):
      raise ValueError(f"cache: expected a BovCache (or None), got {type(cache).__name__}")
    return (BovCache() if use_cache and cache is None else cache), use_cache

  def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
              use_cache=None, return_dict=None, inputs_embeds=None, **kwargs):
    """Hidden states [B, T, D] after the last RMSNorm (and, with use_cache, the BovCache)."""
    if inputs_embeds is not None:
      raise ValueError("BovGPT reads token ids (its bank layers look values up by id), not "
                       "inputs_embeds")
    cache, use_cache = self._cache_for(cache, use_cache)
    h = self.hidden(input_ids, attention_mask, position_ids, cache)
    if return_dict is False:
      return (h,)
    return BaseModelOutputWithPast(last_hidden_state=h, past_key_values=cache if use_cache
                                   else None)


class BovGPTForCausalLM(BovGPTModel, GenerationMixin):
  """The model and its LM head: soft-capped logits. The parameters are BovGPTModel's and
  `lm_head` [D, padded vocab], applied as h @ W."""

  def __init__(self, config: BovGPTConfig):
    super().__init__(config)
    self.lm_head = _param(config.hidden_size, config.padded_vocab_size)
    self.post_init()

  @classmethod
  def _supports_default_dynamic_cache(cls) -> bool:
    return False  # generate leaves the cache to forward, which makes a BovCache

  def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
              use_cache=None, labels=None, logits_to_keep=0, inputs_embeds=None, **kwargs):
    """Logits [B, T, V] (float32, soft-capped); with use_cache, the BovCache too. A 2D
    attention_mask (left padding) marks the real tokens; positions count only those."""
    if inputs_embeds is not None:
      raise ValueError("BovGPT reads token ids (its bank layers look values up by id), not "
                       "inputs_embeds")
    cache, use_cache = self._cache_for(cache, use_cache)
    h = self.hidden(input_ids, attention_mask, position_ids, cache)
    if logits_to_keep:
      h = h[:, -logits_to_keep:]
    z = (h @ self.lm_head.to(h.dtype))[..., :self.config.vocab_size].float()
    c = self.config.logit_softcap
    logits = c * torch.tanh(z / c)
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                             labels[:, 1:].reshape(-1), ignore_index=-100)
    return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

  def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, **kwargs):
    """The tokens the cache has not seen (all of them at first), the whole mask."""
    seen = 0 if cache is None or cache.ids is None else cache.ids.shape[1]
    return {"input_ids": input_ids[:, seen:], "cache": cache, "attention_mask": attention_mask,
            "use_cache": kwargs.get("use_cache")}
