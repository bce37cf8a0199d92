"""parallel/topology.py: TPU slices by gcloud's names, and their compile-only devices."""
import platform
import sys

import pytest

from bov_jax.parallel import topology


def test_topologies_are_gcloud_names():
  chip, n, dims = topology.parse_topology("v5p-64")
  assert (chip.family, n, dims, chip.cores_per_chip) == ("v5p", 32, "2x4x4", 2)
  assert topology.parse_topology("v5litepod-16")[1:] == topology.parse_topology("v5e-16")[1:] == (16, "4x4")
  assert topology.parse_topology("v4-32")[1] == 16 and topology.parse_topology("v6e-8")[1] == 8
  for bad in ("v5p-63", "v7-8", "v5e", "tpu"):
    with pytest.raises(topology.TopologyError, match="known: .*v5p-64"):
      topology.parse_topology(bad)


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                    reason="libtpu's wheel exists for Linux x86-64 only (pip install '.[tpu]')")
def test_a_slice_has_its_compile_only_devices():
  devices, chip = topology.devices("v5e-4")
  assert len(devices) == 4 and devices[0].device_kind == "TPU v5 lite"
  assert chip.hbm_bytes == int(15.75 * topology.GiB)
  assert topology.devices("v5e-4") is topology.devices("v5e-4")  # described once


def test_several_slices_are_named_by_a_count():
  assert topology.split_slices("2xv5p-64") == (2, "v5p-64")
  assert topology.split_slices("v5p-64") == (1, "v5p-64")
  assert topology.with_slices("v5e-16", 4) == "4xv5e-16"
  assert topology.with_slices("4xv5e-16", 1) == topology.with_slices("4xv5e-16", 4) == "4xv5e-16"
  assert topology.parse_topology("2xv5p-64")[1] == 32  # chips of each slice
  with pytest.raises(topology.TopologyError, match="is 2 slices, but mesh.slices=3"):
    topology.with_slices("2xv5p-64", 3)


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                    reason="libtpu's wheel exists for Linux x86-64 only (pip install '.[tpu]')")
def test_two_slices_have_their_chips_slice_by_slice():
  devices, _ = topology.devices("2xv5e-4")
  assert [d.slice_index for d in devices] == [0] * 4 + [1] * 4
