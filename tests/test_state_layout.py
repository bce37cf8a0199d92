"""The optimizer's state layout: each parameter's share of the update over data replicas."""
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from bov_jax.parallel import sharding
from bov_jax.parallel import state_layout
from tests.helpers import small_config


def test_the_update_specs_add_data_to_one_dimension():
  c = small_config()
  c.mesh.data, c.mesh.fsdp = 2, 4
  mesh = sharding.make_mesh(c.mesh)
  shapes = {"w": jax.ShapeDtypeStruct((64, 256), np.float32),
            "t": jax.ShapeDtypeStruct((128, 32), np.float32),
            "odd": jax.ShapeDtypeStruct((3, 5), np.float32),
            "s": jax.ShapeDtypeStruct((), np.float32)}
  specs = {"w": P("fsdp", None), "t": P(None, "fsdp"), "odd": P(), "s": P()}
  got = state_layout.update_specs(specs, shapes, mesh)
  assert got == {"w": P(("data", "fsdp"), None), "t": P("data", "fsdp"), "odd": P(), "s": P()}
  assert [state_layout.data_dim(got[k]) for k in ("w", "t", "odd")] == [0, 0, -1]
  c.mesh.data, c.mesh.fsdp = 1, 8
  one = sharding.make_mesh(c.mesh)
  assert state_layout.update_specs(specs, shapes, one) is specs  # no data replicas
