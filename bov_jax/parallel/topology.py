"""TPU slices by gcloud's accelerator types (v5p-64, v5e-16 or v5litepod-16, v6e-8,
v4-32, ...; several slices of one type as 2xv5p-64): each generation's chips and the HBM
the compiler gives a program, and the compile-only devices of one or more slices
(`jax.experimental.topologies`, with libtpu installed: `pip install '.[tpu]'`), which
describe the chips without owning one (each with its `slice_index`).
"""

from __future__ import annotations

import dataclasses
import functools
import os

# Compiling needs libtpu, which by default one process per host may load: here it drives
# no chip, so processes that compile side by side (tests, a run beside a check) may share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation: how gcloud's accelerator types count it and what the compiler
  gives a program of its HBM."""
  family: str            # the topology's prefix (v5e for v5litepod)
  chip_config: str
  hbm_bytes: int         # per chip, as the compiler reports it (a little under the nominal)
  cores_per_chip: int    # what N in "<type>-N" counts per chip: TensorCores (2) or chips (1)
  shapes: dict           # chips -> topology dims
  peak_flops: float      # bf16 FLOP/s per chip (Cloud TPU's system architecture pages)


_CUBE = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
         256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_PLANE = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
          256: "16x16"}
CHIPS = {
    "v4": Chip("v4", "megacore", int(30.75 * GiB), 2, _CUBE, 275e12),
    "v5p": Chip("v5p", "megacore", int(95.74 * GiB), 2, _CUBE, 459e12),
    "v5e": Chip("v5e", "default", int(15.75 * GiB), 1, _PLANE, 197e12),
    "v6e": Chip("v6e", "default", int(31.25 * GiB), 1, _PLANE, 918e12)}
ALIASES = {"v5litepod": "v5e"}


class TopologyError(ValueError):
  """An accelerator type this module does not know, or no TPU compiler here."""


def known_topologies() -> list[str]:
  return [f"{name}-{n * chip.cores_per_chip}" for name, chip in CHIPS.items()
          for n in chip.shapes]


def split_slices(name: str) -> tuple[int, str]:
  """(slices, one slice's type) of a name such as 2xv5p-64 (v5p-64: one slice)."""
  count, x, one = name.partition("x")
  if x and count.isdigit() and int(count) >= 1:
    return int(count), one
  return 1, name


def with_slices(name: str, slices: int) -> str:
  """The name of `slices` slices of `name`'s type (mesh.slices with --topology=v5p-64:
  2xv5p-64); raises TopologyError where the name already says another count."""
  named, one = split_slices(name)
  if named > 1 and slices > 1 and named != slices:
    raise TopologyError(f"--topology={name} is {named} slices, but mesh.slices={slices}")
  n = max(named, slices)
  return one if n == 1 else f"{n}x{one}"


def parse_topology(name: str) -> tuple[Chip, int, str]:
  """(chip, chips, topology dims) of one slice of a gcloud accelerator type such as
  v5p-64 (or of each slice of 2xv5p-64)."""
  name = split_slices(name)[1]
  family, _, count = name.partition("-")
  chip = CHIPS.get(ALIASES.get(family, family))
  n = int(count) // chip.cores_per_chip if chip and count.isdigit() else 0
  if chip is None or n not in chip.shapes or int(count) % chip.cores_per_chip:
    raise TopologyError(f"--topology={name!r} is not a known TPU slice; known: "
                        + ", ".join(known_topologies()) + " (v5litepod-N = v5e-N; several "
                        "slices: 2xv5p-64)")
  return chip, n, chip.shapes[n]


@functools.lru_cache(maxsize=8)  # asked when the spec is resolved and when the mesh is made
def devices(name: str):
  """(the compile-only devices of every slice, slice by slice, and the chip) for a gcloud
  accelerator type, or several slices of one (2xv5p-64)."""
  slices, _ = split_slices(name)
  chip, n, dims = parse_topology(name)
  try:
    from jax.experimental import topologies
    bounds = {"chips_per_host_bounds": (2, 2, 1)} if chip.shapes is _CUBE else {}
    desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{chip.family}:{dims}",
                                        chip_config_name=chip.chip_config, num_slices=slices,
                                        **bounds)
  except Exception as e:  # noqa: BLE001 - no libtpu, or it refuses the topology
    raise TopologyError(f"cannot describe {name} for the TPU compiler ({type(e).__name__}: "
                        f"{str(e)[:200]}); install it with pip install '.[tpu]' (Linux x86-64)"
                        ) from None
  return tuple(desc.devices), chip


# -- what a compiled program takes per chip --------------------------------------------
