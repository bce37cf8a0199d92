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


def test_across_slices_a_chosen_parameters_share_is_split_by_slice_too():
  """Over two slices the parameters `across_slices` picks are split over data x slice
  (slice minor) on their smallest dimension that divides, the others over data only,
  on the first, as in one slice."""
  c = small_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.slices = 8, 1, 2
  mesh = sharding.make_mesh(c.mesh)
  shapes = {"w": jax.ShapeDtypeStruct((64, 256), np.float32),
            "tall": jax.ShapeDtypeStruct((256, 64), np.float32),
            "e": jax.ShapeDtypeStruct((64, 32), np.float32)}
  specs = {"w": P(), "tall": P(), "e": P()}
  got = state_layout.update_specs(specs, shapes, mesh, lambda path: path[0] != "e")
  assert got == {"w": P(("data", "slice"), None), "tall": P(None, ("data", "slice")),
                 "e": P("data", None)}
  assert [state_layout.data_dim(got[k]) for k in ("w", "tall", "e")] == [0, 1, 0]
  odd = {"tall": jax.ShapeDtypeStruct((256, 12), np.float32)}  # 12 does not divide by 16
  assert state_layout.update_specs({"tall": P()}, odd, mesh, lambda _: True) == {
      "tall": P(("data", "slice"), None)}
  assert state_layout.update_specs(specs, shapes, mesh) == {k: P("data", None) for k in specs}
