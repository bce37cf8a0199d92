"""The PyTorch transcription timed by `bench train --reference=torch` is the same model
and optimizer as ours (torch is optional: skipped where it is not installed)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="the PyTorch reference is the optional torch extra: "
                            "pip install -e '.[torch]'")

from benchmarks import torch_reference  # noqa: E402
from bov_jax.optim import optimizer as optim  # noqa: E402
from tests.helpers import init_model  # noqa: E402
from tests.helpers import model_spec  # noqa: E402
from tests.helpers import slow_except  # noqa: E402
from tests.helpers import small_config  # noqa: E402


def _t(x):
  return torch.from_numpy(np.array(x, dtype=np.float32))


@pytest.mark.parametrize("preset", slow_except(  # the bank fast, the baseline in the slow set
    ["gpt_base", "gpt_base_v_from_value_emb_learn"], ["gpt_base_v_from_value_emb_learn"]))
def test_transcription_computes_our_loss(preset):
  """Our weights copied into the transcription (Linear layers are stored [out, in])
  give the same loss on the same tokens."""
  cfg = small_config(preset)  # GQA and sliding windows
  ours = init_model(cfg, jax.random.key(0))
  # Random values everywhere (the init zeroes the output projections and lambda).
  state = nnx.state(ours, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  nnx.update(ours, jax.tree.unflatten(treedef, [
      0.5 + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 0 else 0.1 * jax.random.normal(k, x.shape)
      for k, x in zip(keys, leaves)]))
  banks = {i for i, b in enumerate(ours.blocks) if b.attn.wv is None}
  assert bool(banks) == (preset != "gpt_base")
  ref = torch_reference.GPT(model_spec(cfg), banks)
  V = cfg.model.vocab_size
  with torch.no_grad():
    ref.wte.weight[:V] = _t(ours.wte[...][:V])
    ref.lm_head.weight[:V] = _t(ours.lm_head[...][:, :V].T)
    ref.smear_gate.weight[0] = _t(ours.smear_w[...])
    ref.smear_lambda[0] = float(ours.smear_lambda[...])
    for i, (rb, b) in enumerate(zip(ref.blocks, ours.blocks)):
      a = b.attn
      rb.attn.c_q.weight[:] = _t(a.wq[...].T)
      rb.attn.c_k.weight[:] = _t(a.wk[...].T)
      rb.attn.c_proj.weight[:] = _t(a.wo[...].T)
      rb.c_fc.weight[:] = _t(b.mlp.w_fc[...].T)
      rb.mlp_proj.weight[:] = _t(b.mlp.w_proj[...].T)
      if i in banks:
        rb.attn.value_embed.weight[:V] = _t(ours.tables[ours.table_of[i]][...][:V])
        rb.attn.gamma_v[0] = float(a.coeffs["gamma"][...])
      else:
        rb.attn.c_v.weight[:] = _t(a.wv[...].T)
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 65), 0, V))
  x, y = tokens[:, :-1], tokens[:, 1:]
  want = float(ours.loss(jnp.asarray(x), jnp.asarray(y)))
  with torch.no_grad():
    got = ref(torch.tensor(x).long(), torch.tensor(y).long()).item()
  assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("polar_dtype,compiled", [
    ("float32", False), ("bfloat16", False),
    pytest.param("float32", True, marks=pytest.mark.slow)])  # slow: torch.compile's compile
def test_transcription_muon_is_our_muon(polar_dtype, compiled):
  """Two steps on matrices of three shapes (two of one shape, stacked as the
  reference stacks them), gradients with uneven row and column scales (so the
  variance reduction matters): the same parameters as ours. In float32 to
  rounding; in the reference's bfloat16 (ours still float32) the same direction.
  Compiled (torch.compile, as `bench train --reference=torch_compiled` runs it): the same."""
  lr, mom, wd = 0.02, 0.9, 0.28
  rng = np.random.default_rng(0)
  shapes = [(48, 48), (48, 48), (96, 32), (32, 96)]  # ours: [fan_in, fan_out]
  params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  grads = [[(rng.standard_normal(s) * rng.uniform(0.1, 3, (s[0], 1)) * rng.uniform(0.1, 3, s[1])
             ).astype(np.float32) for s in shapes] for _ in range(2)]
  tx = optim.muon(lambda it: lr, lambda it: mom, lambda it: wd)
  p = [jnp.asarray(a) for a in params]
  state = tx.init(p)
  tp = [torch.nn.Parameter(_t(a.T)) for a in params]
  opt = torch_reference.Muon(tp, lr=lr, momentum=mom, weight_decay=wd,
                             polar_dtype=getattr(torch, polar_dtype), compiled=compiled)
  for gs in grads:
    upd, state = tx.update([jnp.asarray(g) for g in gs], state, p)
    p = optax.apply_updates(p, upd)
    for t, g in zip(tp, gs):
      t.grad = _t(g.T)
    opt.step()
  for t, w, p0 in zip(tp, p, params):
    got, want = t.detach().numpy().T - p0, np.asarray(w) - p0
    if polar_dtype == "float32":
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    else:
      cos = np.sum(got * want) / (np.linalg.norm(got) * np.linalg.norm(want))
      assert cos > 0.99, cos
      assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(want), rel=0.03)
