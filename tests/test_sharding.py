"""Meshes, sharding rules, the split table lookup, and sharded == unsharded training."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from bov_jax.model import gpt as model_lib
from bov_jax.model import params as params_lib
from bov_jax.parallel import lookup
from bov_jax.parallel import sharding
from bov_jax.run import plan
from bov_jax.training import step as step_lib
from tests.helpers import TINY_RUN
from tests.helpers import command
from tests.helpers import model_spec
from tests.helpers import run_spec
from tests.helpers import sgd_step_on_mesh_and_one_device
from tests.helpers import small_config
from tests.helpers import xla_flags

MESHES = [(2, 2, 2), (1, 8, 1), (1, 1, 8), (8, 1, 1), (2, 4, 1), (1, 2, 4)]


def _mesh(data, fsdp, tensor):
  c = small_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
  return sharding.make_mesh(c.mesh)


def test_mesh_shape_rules():
  c = small_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 2, 2
  assert sharding.mesh_shape(c.mesh, 8) == (2, 2, 2)
  c.mesh.fsdp = 3
  with pytest.raises(ValueError, match="not divisible"):
    sharding.mesh_shape(c.mesh, 8)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 1
  with pytest.raises(ValueError, match="4 devices, but 8 are available"):
    sharding.mesh_shape(c.mesh, 8)


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("impl", ["shard_map", "gather", "one_hot"])
def test_table_lookup_matches_plain_gather(shape, impl):
  mesh = _mesh(*shape)
  V, D, B, T = 128, 16, 8, 12
  table = jax.random.normal(jax.random.key(0), (V, D))
  idx = jax.random.randint(jax.random.key(1), (B, T), 0, V)
  cot = jax.random.normal(jax.random.key(2), (B, T, D))
  want = jnp.take(table, idx, axis=0)
  want_grad = jnp.zeros_like(table).at[idx].add(cot)
  spec = sharding.logical_to_spec(("table_vocab", "table_width"), (V, D), mesh)
  with jax.set_mesh(mesh):
    t = jax.device_put(table, NamedSharding(mesh, spec))
    i = jax.device_put(idx, sharding.batch_sharding(mesh))

    @jax.jit
    def f(t, i):
      rows, vjp = jax.vjp(lambda t: lookup.table_lookup(t, i, impl), t)
      return rows, vjp(cot)[0]

    rows, grad = f(t, i)
  np.testing.assert_allclose(np.asarray(rows), np.asarray(want), atol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), atol=1e-5)


def _params_on(mesh, cfg, seed=0):
  _, params, shardings = params_lib.init_params(model_spec(cfg), mesh, jax.random.key(seed))
  return params, shardings


@pytest.mark.slow
@pytest.mark.parametrize("shape, scan", [((2, 2, 2), "true"), ((1, 8, 1), "true"),
                                         ((1, 2, 4), "true"), ((1, 8, 1), "false")])
def test_sharded_step_equals_unsharded(shape, scan):
  """Loss and gradients (through the accumulation scan and the layers' scan, tables
  included) match one device."""
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=120, n_layer=3, scan=scan)
  assert any(s.scanned for s in model_spec(cfg).stages) == (scan == "true")
  idx = jax.random.randint(jax.random.key(3), (2, 8, 17), 0, 120)  # 2 micro-batches of 8 rows
  (ref_params, ref_out), (new_params, out), p8 = sgd_step_on_mesh_and_one_device(cfg, idx, shape)
  assert float(out["train_loss"]) == pytest.approx(float(ref_out["train_loss"]), rel=1e-5)
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_params))
  for path, v in jax.tree_util.tree_leaves_with_path(new_params):
    want = np.asarray(flat_ref[path])
    np.testing.assert_allclose(np.asarray(v), want, rtol=1e-4, atol=2e-6,
                               err_msg=jax.tree_util.keystr(path))
  g = np.asarray(p8["tables"]["layer_2"]) - np.asarray(new_params["tables"]["layer_2"])
  assert np.abs(g).max() > 0  # the table gradient was part of the comparison


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1), (1, 1, 8)])
def test_each_table_shard_is_one_nth(shape):
  mesh = _mesh(*shape)
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=500)  # padded 512
  params, _ = _params_on(mesh, cfg)
  fsdp, tensor = shape[1], shape[2]  # the width splits over fsdp, the vocabulary over tensor
  for name, table in params["tables"].items():
    assert table.shape == (512, 32)
    shards = table.addressable_shards
    assert len(shards) == 8
    assert all(s.data.shape == (512 // tensor, 32 // fsdp) for s in shards), name


def _all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
  shapes = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*(.*?)\s+all-gather(?:-start)?\(", line)
    if m:
      for dims in re.findall(r"\w+\[([\d,]+)\]", m.group(1)):
        shapes.append(tuple(int(d) for d in dims.split(",")))
  return shapes


def _table_like(shape):
  """[rows, 16] with at least half the vocabulary: a (near-)whole value table."""
  return len(shape) == 2 and shape[1] == 16 and shape[0] >= 1024


def _compiled_step_hlo(shape, impl):
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=2048, n_embd=64, n_head=4,
                     n_kv_head=1, table_lookup=impl, n_layer=3)
  mesh = _mesh(*shape)
  graphdef = nnx.graphdef(model_lib.abstract(model_spec(cfg)))
  params, shardings = _params_on(mesh, cfg)
  tx = optax.sgd(0.1)
  bsh = sharding.batch_sharding(mesh, leading_dims=2)
  x = jax.device_put(jnp.zeros((1, 8, 16), jnp.int32), bsh)
  with jax.set_mesh(mesh):
    f = jax.jit(step_lib.make_train_step(graphdef, tx), in_shardings=(shardings, None, bsh, bsh),
                out_shardings=(shardings, None, None))
    return f.lower(params, tx.init(params), x, x).compile().as_text()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1)])
def test_step_never_all_gathers_a_value_table(shape):
  """Tables are [2048, 16] (kv_dim 16); no other parameter has that second dim."""
  shapes = _all_gather_shapes(_compiled_step_hlo(shape, "shard_map"))
  assert shapes  # FSDP does gather the block weights
  assert not any(_table_like(s) for s in shapes), shapes
  # the check can fail: a lookup on a table made whole first shows up as (2048, 16)
  mesh = _mesh(*shape)
  spec = sharding.logical_to_spec(("table_vocab", "table_width"), (2048, 16), mesh)
  with jax.set_mesh(mesh):
    t = jax.device_put(jnp.zeros((2048, 16)), NamedSharding(mesh, spec))
    i = jax.device_put(jnp.zeros((8, 16), jnp.int32), sharding.batch_sharding(mesh))
    whole = jax.jit(lambda t, i: jnp.take(jax.lax.with_sharding_constraint(
        t, NamedSharding(mesh, jax.sharding.PartitionSpec())), i, axis=0))
    naive = _all_gather_shapes(whole.lower(t, i).compile().as_text())
  assert any(_table_like(s) for s in naive), naive


def test_plan_reports_bytes_per_device():
  from bov_jax.settings import config as config_lib
  one = config_lib.depth_config(24, "gpt_base_v_from_value_emb_learn")
  one.mesh.data, one.mesh.fsdp, one.mesh.tensor = 1, 1, 1
  eight = config_lib.depth_config(24, "gpt_base_v_from_value_emb_learn")
  eight.mesh.data, eight.mesh.fsdp, eight.mesh.tensor = 1, 8, 1
  a, b = plan.memory_per_device(run_spec(one)), plan.memory_per_device(run_spec(eight))
  m = model_spec(one)
  n_params = plan.param_counts(m)["params"]
  stored_2 = m.padded_vocab * m.n_embd * (1 + 8)  # wte and eight tables: bfloat16 (auto)
  assert a["param_bytes_per_device"] == 4 * n_params - 2 * stored_2
  assert b["param_bytes_per_device"] <= a["param_bytes_per_device"] / 8 * 1.05
  assert b["optimizer_bytes_per_device"] <= a["optimizer_bytes_per_device"] / 8 * 1.05
  assert a["optimizer_bytes_per_device"] > a["param_bytes_per_device"]  # moments + Muon buffers
  replicas = config_lib.depth_config(24, "gpt_base_v_from_value_emb_learn")
  replicas.mesh.data, replicas.mesh.fsdp, replicas.mesh.tensor = 8, 1, 1
  c = plan.memory_per_device(run_spec(replicas))  # the optimizer's state split, not the weights
  assert c["param_bytes_per_device"] == a["param_bytes_per_device"]
  assert c["optimizer_bytes_per_device"] <= a["optimizer_bytes_per_device"] / 8 * 1.05
  replicas.optim.shard_optimizer = False
  d = plan.memory_per_device(run_spec(replicas))
  assert d["optimizer_bytes_per_device"] == a["optimizer_bytes_per_device"]


@pytest.mark.slow
def test_mesh_training_matches_one_device_and_reshards_on_resume(tmp_path):
  """tiny on data=2 x fsdp=2 x tensor=2 (8 simulated devices) == one device at step 6;
  the same workdir then resumes on data=8 (a different mesh) and reaches step 9."""
  import json
  import os
  common = ["--config=configs/tiny.py", *TINY_RUN, "--config.train.eval_every=100",
            "--config.train.sample_tokens=0", "--config.train.checkpoint_every=3"]

  def main(workdir, devices, *extra):
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices))
    out = command("main", f"--workdir={workdir}",
                  *common, *extra, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return out, {r["step"]: r for r in map(json.loads, f) if "train_loss" in r}

  _, one = main(str(tmp_path / "one"), 1, "--config.train.num_iterations=6")
  wd = str(tmp_path / "mesh")
  _, eight = main(wd, 8, "--config.train.num_iterations=6", "--config.mesh.data=2",
                  "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
  assert eight[6]["train_loss"] == pytest.approx(one[6]["train_loss"], rel=2e-3)
  out, resumed = main(wd, 8, "--config.train.num_iterations=9", "--config.mesh.data=8",
                      "--config.mesh.fsdp=1", "--config.mesh.tensor=1")
  assert "checkpoints/6" in out.stdout
  assert max(resumed) == 9 and np.isfinite(resumed[9]["train_loss"])


def test_path_keys_are_dict_keys_and_indices():
  from typing import NamedTuple

  class State(NamedTuple):
    mu: dict
  tree = {"blocks": [{"w": 1}], "opt": State(mu={"lm_head": 2})}
  paths = [sharding.path_keys(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  assert paths == [("blocks", 0, "w"), ("opt", "lm_head")]  # the field `mu` is left out


def test_slices_split_the_data_axis_outermost():
  """mesh.slices: the data axis split into slices x data a slice, each slice a block of
  devices (in order within one process); FSDP or tensor across slices is refused."""
  c = small_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.slices = 4, 2, 2
  assert sharding.mesh_sizes(c.mesh, 8) == {"slice": 2, "data": 2, "fsdp": 2, "tensor": 1}
  mesh = sharding.make_mesh(c.mesh)
  ids = [[d.id for d in block.flat] for block in mesh.devices]
  assert sorted(ids[0]) == [d.id for d in jax.devices()[:4]]
  assert sorted(ids[1]) == [d.id for d in jax.devices()[4:]]
  c.mesh.data, c.mesh.fsdp = 1, 8
  with pytest.raises(ValueError, match="mesh.slices=2 must divide mesh.data=1.*fsdp=8"):
    sharding.mesh_sizes(c.mesh, 8)
  c.mesh.data, c.mesh.fsdp, c.mesh.slices = -1, 1, 0
  with pytest.raises(ValueError, match="mesh.slices=0: expected"):
    sharding.mesh_sizes(c.mesh, 8)
