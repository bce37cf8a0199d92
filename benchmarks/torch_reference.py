"""A PyTorch transcription of the same model and optimizer (the reference's gpt.py and
optim.py, for two presets).

Used only by `python -m benchmarks.train --reference=torch` to time the
reference-style PyTorch step on the same machine in the same run; torch is
imported only here. It follows the reference code's structure (Linear layers
stored [out, in], F.scaled_dot_product_attention, the NorMuon-style Muon and
torch AdamW groups), covering the two presets the speed comparison uses:
`gpt_base` and `gpt_base_v_from_value_emb_learn`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bov_jax.kernels import polar


def _norm(x):
  return F.rms_norm(x, (x.size(-1),))


class Attention(nn.Module):

  def __init__(self, d, H, K, bank: bool, vocab_padded: int):
    super().__init__()
    self.H, self.K, self.E = H, K, d // H
    self.c_q = nn.Linear(d, H * self.E, bias=False)
    self.c_k = nn.Linear(d, K * self.E, bias=False)
    self.c_v = None if bank else nn.Linear(d, K * self.E, bias=False)
    self.c_proj = nn.Linear(d, d, bias=False)
    self.bank = bank
    if bank:
      self.gamma_v = nn.Parameter(torch.ones(1))
      self.value_embed = nn.Embedding(vocab_padded, K * self.E)

  def forward(self, x, idx, cos, sin, window):
    B, T, _ = x.shape
    q = self.c_q(x).view(B, T, self.H, self.E)
    k = self.c_k(x).view(B, T, self.K, self.E)
    if self.bank:
      v = self.gamma_v * self.value_embed(idx).view(B, T, self.K, self.E)
    else:
      v = self.c_v(x).view(B, T, self.K, self.E)

    def rope(t):
      h = t.size(-1) // 2
      t1, t2 = t[..., :h], t[..., h:]
      return torch.cat([t1 * cos + t2 * sin, -t1 * sin + t2 * cos], dim=-1)

    q, k = _norm(rope(q)) * 1.2, _norm(rope(k)) * 1.2
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if window >= T:
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.H != self.K)
    else:
      i = torch.arange(T)
      mask = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] <= window)
      y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.H != self.K)
    return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):

  def __init__(self, d, H, K, bank, vp):
    super().__init__()
    self.attn = Attention(d, H, K, bank, vp)
    self.c_fc = nn.Linear(d, 4 * d, bias=False)
    self.mlp_proj = nn.Linear(4 * d, d, bias=False)

  def forward(self, x, idx, cos, sin, window):
    x = x + self.attn(_norm(x), idx, cos, sin, window)
    return x + self.mlp_proj(F.relu(self.c_fc(_norm(x))).square())


class GPT(nn.Module):

  def __init__(self, m, bank_layers):
    """m: a spec.ModelSpec."""
    super().__init__()
    d, H, K, L = m.n_embd, m.n_head, m.n_kv_head, m.n_layer
    self.vocab = m.vocab_size
    vp = -(-m.vocab_size // 64) * 64
    self.wte = nn.Embedding(vp, d)
    self.lm_head = nn.Linear(d, vp, bias=False)
    self.smear_gate = nn.Linear(24, 1, bias=False)
    self.smear_lambda = nn.Parameter(torch.zeros(1))
    self.blocks = nn.ModuleList([Block(d, H, K, i in bank_layers, vp) for i in range(L)])
    self.windows = m.windows
    E = d // H
    inv = 1.0 / (100000 ** (torch.arange(0, E, 2).float() / E))
    ang = torch.arange(m.sequence_len).float()[:, None] * inv[None]
    self.register_buffer("cos", ang.cos()[None, :, None, :], persistent=False)
    self.register_buffer("sin", ang.sin()[None, :, None, :], persistent=False)
    s = math.sqrt(3) / math.sqrt(d)
    with torch.no_grad():
      nn.init.normal_(self.wte.weight, std=0.8)
      nn.init.normal_(self.lm_head.weight, std=0.001)
      nn.init.uniform_(self.smear_gate.weight, 0, 0.02)
      for b in self.blocks:
        for lin in (b.attn.c_q, b.attn.c_k, b.attn.c_v):
          if lin is not None:
            nn.init.uniform_(lin.weight, -s, s)
        nn.init.uniform_(b.c_fc.weight, -0.4 * s, 0.4 * s)
        nn.init.zeros_(b.attn.c_proj.weight)
        nn.init.zeros_(b.mlp_proj.weight)
        if b.attn.bank:
          nn.init.uniform_(b.attn.value_embed.weight, -s, s)

  def forward(self, idx, targets):
    B, T = idx.shape
    x = _norm(self.wte(idx))
    g = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, 1:, :24]))
    x = torch.cat([x[:, :1], x[:, 1:] + g * x[:, :-1]], dim=1)
    cos, sin = self.cos[:, :T], self.sin[:, :T]
    for b, w in zip(self.blocks, self.windows):
      x = b(x, idx, cos, sin, w)
    logits = self.lm_head(_norm(x))[..., :self.vocab].float()
    logits = 15 * torch.tanh(logits / 15)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def muon_shape_step(g, params, buf, buf2, momentum, lr, wd, polar_dtype=torch.bfloat16):
  """Muon on the stacked matrices of one shape [n, rows, cols], in place (params,
  buf, buf2); momentum, lr (already scaled for the shape) and wd are 0-D tensors,
  so a compiled version is not recompiled when the schedules move them."""
  rows, cols = g.shape[-2:]
  red = -1 if rows >= cols else -2
  buf.lerp_(g, 1 - momentum)
  u = g.lerp_(buf, momentum)
  x = u.to(polar_dtype)
  x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
  for a, b, c in polar.POLAR_EXPRESS:
    if rows > cols:
      A = x.mT @ x
      x = a * x + x @ (b * A + c * (A @ A))
    else:
      A = x @ x.mT
      x = a * x + (b * A + c * (A @ A)) @ x
  v = x.float().square().mean(dim=red, keepdim=True)
  n_red = x.size(red)
  norm = (v.sum(dim=(-2, -1), keepdim=True) * n_red).sqrt()
  buf2.lerp_(v, 0.1)
  step = buf2.clamp_min(1e-10).rsqrt()
  new = (v * n_red * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
  x = x * (step * (norm / new.clamp_min(1e-10))).to(x.dtype)
  lr, wd = lr.to(x.dtype), wd.to(x.dtype)
  mask = (x * params) >= 0
  params.sub_(lr * x + lr * wd * params * mask)


class Muon(torch.optim.Optimizer):
  """The reference's Muon (momentum, Polar Express, variance reduction, cautious wd),
  run the way the reference runs it: the matrices of one shape stacked and updated
  together (`muon_shape_step`, compiled when `compiled`), Polar Express in bfloat16
  (SPEC section 4), the tall form X^T X written without transposes. polar_dtype
  other than bfloat16 is for tests."""

  def __init__(self, params, lr, momentum=0.95, weight_decay=0.0, polar_dtype=torch.bfloat16,
               compiled=False):
    super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
    self.polar_dtype = polar_dtype
    self.shape_step = (torch.compile(muon_shape_step, dynamic=False, fullgraph=True)
                       if compiled else muon_shape_step)

  @torch.no_grad()
  def step(self):
    for group in self.param_groups:
      by_shape = {}
      for p in group["params"]:
        by_shape.setdefault(tuple(p.shape), []).append(p)
      for (rows, cols), ps in by_shape.items():
        st = self.state[ps[0]]
        if not st:
          st["buf"] = torch.zeros(len(ps), rows, cols)
          st["buf2"] = torch.zeros((len(ps), rows, 1) if rows >= cols else (len(ps), 1, cols))
        params = torch.stack(ps)
        scalars = (group["momentum"], group["lr"] * max(1.0, rows / cols) ** 0.5,
                   group["weight_decay"])
        self.shape_step(torch.stack([p.grad for p in ps]), params, st["buf"], st["buf2"],
                        *(torch.tensor(float(v)) for v in scalars), self.polar_dtype)
        torch._foreach_copy_(ps, list(params.unbind(0)))


def make_optimizers(model: GPT, compiled: bool = False):
  matrices = [p for b in model.blocks for n, p in b.named_parameters()
              if p.ndim == 2 and "value_embed" not in n]
  tables = [b.attn.value_embed.weight for b in model.blocks if b.attn.bank]
  gammas = [b.attn.gamma_v for b in model.blocks if b.attn.bank]
  groups = [dict(params=[model.lm_head.weight], lr=0.008, betas=(0.8, 0.96), weight_decay=0.01),
            dict(params=[model.wte.weight], lr=0.3, betas=(0.8, 0.995), weight_decay=0.001),
            dict(params=[model.smear_gate.weight, model.smear_lambda], lr=0.2,
                 betas=(0.8, 0.95), weight_decay=0.0)]
  if tables:
    groups.append(dict(params=tables, lr=0.15, betas=(0.8, 0.995), weight_decay=0.01))
    groups.append(dict(params=gammas, lr=0.5, betas=(0.96, 0.95), weight_decay=0.0))
  adam = torch.optim.AdamW(groups, eps=1e-10)
  return [adam, Muon(matrices, lr=0.02, momentum=0.95, weight_decay=0.28, compiled=compiled)]


def make_step(spec, compiled: bool = False):
  """(run, record): run() does one PyTorch step (forward, backward, both optimizers)
  on random tokens and returns its seconds; timed by benchmarks.train.

  compiled: as the reference trains, the model under `torch.compile` and Muon's
  per-shape step compiled too (TorchInductor; needs a C++ compiler; the first
  run compiles, which the bench's warm-up absorbs)."""
  import time
  torch.manual_seed(0)
  mode = spec.model.value
  if mode.preset not in ("gpt_base", "gpt_base_v_from_value_emb_learn"):
    raise ValueError("the PyTorch reference covers gpt_base and gpt_base_v_from_value_emb_learn")
  banks = {i for i, layer_value in enumerate(spec.model.layers) if layer_value.is_bank}
  model = GPT(spec.model, banks)
  opts = make_optimizers(model, compiled)
  forward = torch.compile(model, dynamic=False) if compiled else model
  T, B = spec.model.sequence_len, spec.train.device_batch_size
  accum = max(1, spec.train.batch_tokens // (B * T))
  data = torch.randint(0, spec.model.vocab_size, (accum, B, T + 1))

  def run() -> float:
    t = time.perf_counter()
    for a in range(accum):
      loss = forward(data[a, :, :-1], data[a, :, 1:]) / accum
      loss.backward()
    for o in opts:
      o.step()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t

  return run, {"bench": "train_torch_reference", "preset": mode.preset, "compiled": compiled,
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "tokens_per_step": accum * B * T}
