"""The train step split over the mesh (optim.shard_optimizer): the same training as one
device, checkpoints that move between layouts, each device's share of the optimizer."""
import jax
import numpy as np
import pytest
from flax import nnx

from bov_jax.parallel import sharding
from bov_jax.parallel import state_layout
from bov_jax.store import checkpoint
from bov_jax.training import step as step_lib
from tests.helpers import random_model
from tests.helpers import run_spec
from tests.helpers import small_config

STEPS, ACCUM, ROWS = 5, 2, 8  # five steps of two micro-batches of eight rows


def _config(mesh_shape, shard=True):
  """A BoV model of three layers (the last a bank layer) on a mesh, fp32 throughout.
  Polar Express in float32 and no weight decay: bfloat16 operands and the cautious
  decay's mask (x * p >= 0, a threshold) turn float32 rounding into differences
  far above it, and any change of summation order shows them, one device's included."""
  c = small_config("gpt_base_v_from_value_emb_learn", vocab_size=128, n_layer=3)
  c.optim.polar_dtype, c.optim.weight_decay, c.optim.shard_optimizer = "float32", 0.0, shard
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.slices = (*mesh_shape, 1)[:4]
  n = int(np.prod(mesh_shape[:3]))
  c.train.batch_tokens, c.train.device_batch_size = 64 * ROWS * ACCUM, ROWS // n
  return c


def _setup(mesh_shape, shard=True):
  spec = run_spec(_config(mesh_shape, shard))
  mesh = sharding.make_mesh(spec.mesh, jax.devices()[:int(np.prod(mesh_shape[:3]))])
  return mesh, step_lib.build(spec, mesh, num_iterations=10)


def _start(tr):
  """Every parameter non-zero (init leaves the output projections at zero), on tr's layout."""
  params = nnx.to_pure_dict(nnx.state(random_model(_config((1, 1, 1)), seed=9, scale=0.05)))
  return jax.device_put(params, tr.param_shardings), tr.opt_state


def _train(mesh, tr, params, opt_state, steps, first=0):
  tokens = np.random.default_rng(1).integers(0, 128, (STEPS + 2, ACCUM, ROWS, 65))
  bsh = sharding.batch_sharding(mesh, leading_dims=2)
  losses = []
  with jax.set_mesh(mesh):
    for s in range(first, first + steps):
      x, y = (jax.device_put(tokens[s, ..., a:a + 64], bsh) for a in (0, 1))
      params, opt_state, out = tr.train_step(params, opt_state, x, y)
      losses.append(float(out["train_loss"]))
  return losses, params, opt_state


def _assert_close(got, want, rtol):
  """Each tensor within rtol of the other in norm (an element at a threshold is not one
  tensor's difference)."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def one_device():
  mesh, tr = _setup((1, 1, 1))
  return _train(mesh, tr, *_start(tr), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 4, 1), (8, 1, 1, 2), (4, 2, 1, 2)])
def test_split_step_trains_as_one_device(mesh_shape, one_device):
  """(data, fsdp, tensor[, slices]): two slices stand in as two halves of the devices."""
  mesh, tr = _setup(mesh_shape)
  assert any(state_layout.data_dim(s.spec) >= 0 for s in jax.tree.leaves(tr.opt_shardings))
  losses, params, _ = _train(mesh, tr, *_start(tr), STEPS)
  np.testing.assert_allclose(losses, one_device[0], rtol=1e-6)
  _assert_close(jax.device_get(params), jax.device_get(one_device[1]), 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, restored_on", [((8, 1, 1), (1, 1, 1)),
                                                   ((2, 4, 1), (1, 8, 1)),
                                                   ((1, 1, 1), (2, 4, 1)),
                                                   ((8, 1, 1, 2), (1, 1, 1)),
                                                   ((2, 1, 1), (4, 2, 1, 2))])
def test_a_checkpoint_moves_between_layouts(tmp_path, saved_on, restored_on, one_device):
  """Three steps on one layout, saved; restored on another, two more steps: the five
  steps of one device."""
  mesh, tr = _setup(saved_on)
  _, params, opt_state = _train(mesh, tr, *_start(tr), 3)
  ckpts = checkpoint.Checkpoints(str(tmp_path), async_save=False)
  ckpts.save(3, params, opt_state)
  ckpts.close()
  mesh, tr = _setup(restored_on)
  got = checkpoint.Checkpoints(str(tmp_path)).restore(tr.params, tr.opt_state)
  assert got.step == 3
  assert all(a.sharding == s for a, s in zip(jax.tree.leaves(got.opt_state),
                                             jax.tree.leaves(tr.opt_shardings)))
  losses, params, _ = _train(mesh, tr, got.params, got.opt_state, 2, first=3)
  np.testing.assert_allclose(losses, one_device[0][3:], rtol=1e-6)
  _assert_close(jax.device_get(params), jax.device_get(one_device[1]), 1e-6)


def _update_flops(mesh_shape, shard=True):
  """FLOPs per device of the compiled optimizer update, as the train step runs it, for a
  model of eight layers: 16 Muon matrices of each square shape, 8 of each MLP shape."""
  c = small_config("gpt_base", n_layer=8)
  c.optim.shard_optimizer = shard
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.slices = (*mesh_shape, 1)[:4]
  c.train.batch_tokens, c.train.device_batch_size = 64 * 8, 1
  spec = run_spec(c)
  mesh = sharding.make_mesh(spec.mesh, jax.devices()[:int(np.prod(mesh_shape[:3]))])
  tr = step_lib.build(spec, mesh, num_iterations=10, init=False)
  grads = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                       tr.params, tr.grad_shardings)
  with jax.set_mesh(mesh):
    compiled = tr.update_step.lower(grads, tr.opt_state, tr.params).compile()
  return compiled.cost_analysis()["flops"]


@pytest.mark.slow  # compile-heavy: an 8-layer optimizer update compiled on three meshes
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (1, 8, 1), (8, 1, 1, 2)])
def test_each_device_runs_its_share_of_the_optimizer(mesh_shape):
  """Every stack of Muon matrices divides by the eight devices: the update's FLOPs per
  device are about an eighth of one device's (1.02-1.09 eighths measured: what the
  devices' shares add is the stacks' and shards' bookkeeping), two slices of four
  included (no slice repeats another's Muon); without the split each data replica
  repeats it all."""
  one = _update_flops((1, 1, 1))
  assert _update_flops(mesh_shape) <= one / 8 * 1.15
  if mesh_shape[0] > 1:
    assert _update_flops(mesh_shape, shard=False) >= one


def test_one_device_compiles_the_same_step_either_way():
  texts = []
  for shard in (True, False):
    mesh, tr = _setup((1, 1, 1), shard)
    x = jax.ShapeDtypeStruct((ACCUM, ROWS, 64), np.int32)
    with jax.set_mesh(mesh):
      texts.append(tr.train_step.lower(tr.params, tr.opt_state, x, x).as_text())
  assert texts[0] == texts[1]
