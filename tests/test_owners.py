"""Muon's stacks moved to their owners across slices and back (parallel/owners.py)."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bov_jax.parallel import owners
from bov_jax.parallel import sharding
from tests.helpers import small_config


def _mesh(data, slices, fsdp=1):
  c = small_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.slices = data, fsdp, 1, slices
  return sharding.make_mesh(c.mesh, jax.devices()[:data * fsdp])


def test_each_slice_owns_its_part_of_the_stack_padded_to_its_chips():
  with jax.set_mesh(_mesh(8, 2)):  # 2 slices of 4 chips
    assert owners.slots(6) == [0, 1, 2, None, 3, 4, 5, None]
    assert owners.slots(9) == [0, 1, 2, 3, 4, None, None, None,
                               5, 6, 7, 8, None, None, None, None]
    assert owners.owner_spec() == P(("slice", "data"), None, None)
  with jax.set_mesh(_mesh(4, 2, fsdp=2)):
    assert owners.slots(4) == [0, 1, None, None, 2, 3, None, None]
    assert owners.owner_spec() == P(("slice", "data", "fsdp"), None, None)


@pytest.mark.parametrize("data, fsdp, u_spec", [
    (8, 1, P(("data", "slice"), None)),  # a wide matrix: its rows split
    (8, 1, P(None, ("data", "slice"))),  # a tall one, transposed: its columns
    (4, 2, P(("data", "slice", "fsdp"), None)),
    (2, 1, P("slice", None)),  # one chip a slice
])
def test_the_owners_hold_whole_matrices_and_give_them_back(data, fsdp, u_spec):
  """to_owners puts each matrix whole on the chip of its place in `slots` (the zero
  matrices where none); from_owners brings a stack in that layout back, split as u_spec."""
  mesh = _mesh(data, 2, fsdp)
  n = 6
  x = np.random.default_rng(0).normal(size=(n, 16, 32)).astype(np.float32)
  with jax.set_mesh(mesh):
    stacked = jax.device_put(x, NamedSharding(mesh, P(None, *u_spec)))
    places = owners.slots(n)
    owned = jax.jit(lambda s: owners.to_owners(s, u_spec))(stacked)
    want = np.stack([np.zeros_like(x[0]) if j is None else x[j] for j in places])
    np.testing.assert_array_equal(np.asarray(owned), want)
    assert owned.sharding.is_equivalent_to(NamedSharding(mesh, owners.owner_spec()), 3)
    per_chip = {s.index[0].start: s.data.shape for s in owned.addressable_shards}
    assert all(shape[1:] == (16, 32) for shape in per_chip.values())  # whole matrices
    back = jax.jit(lambda o: owners.from_owners(o * 2, u_spec, n))(owned)
    np.testing.assert_array_equal(np.asarray(back), 2 * x)
