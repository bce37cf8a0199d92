"""The device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes: `slice` (data parallel across TPU slices, over the data-center network:
`mesh.slices`), `data` (pure data parallel inside a slice), `fsdp` (data parallel with
parameters and optimizer state split), `tensor` (within-layer model parallel). Only
`slice` crosses slices (the outermost split of the devices, `make_mesh`); what runs over
it is a step's one reduction of gradients (training/step.py), whose Muon part goes on to
the matrices' owners and comes back as updates (owners.py). Every parameter names its
axes where the model makes it (`logical=`, model/gpt.py); RULES says where each goes.
What runs over the mesh by hand (table lookups, per-shard sums, Muon's owners) is in
lookup.py, rowsum.py and owners.py.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bov_jax.settings.config import ConfigError

MESH_AXES = ("slice", "data", "fsdp", "tensor")
IN_SLICE = ("data", "fsdp", "tensor")  # the axes whose devices share a slice's fast links
BATCH_AXES = ("slice", "data", "fsdp")

# logical axis -> mesh axis (or axes), MaxText style.
RULES = {
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    # A value table [V, K * E] is split over its width on fsdp, where the batch is split
    # too: a lookup then moves each device's rows once (all-to-all, `table_lookup`),
    # and no table is ever gathered whole.
    "table_vocab": "tensor",
    "table_width": "fsdp",
    "batch": BATCH_AXES,  # activations' rows
    # The optimizer's stack of same-shaped matrices (optim.muon): split over every axis
    # of a slice, so each device orthogonalises whole matrices of its own (nanochat's
    # distributed Muon; MaxText's sharding-aware Muon). Over several slices a stack is
    # first divided between the slices (owners.py).
    "stack": IN_SLICE,
}


def path_keys(path) -> tuple:
  """A tree path (jax's key path) as its dict keys and sequence indices; attribute keys
  (a namedtuple's fields in optimizer state) are left out."""
  return tuple(k.key if isinstance(k, jax.tree_util.DictKey) else k.idx for k in path
               if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey)))


def mesh_shape(mesh_cfg, n_devices: int | None = None) -> tuple[int, int, int]:
  """(data, fsdp, tensor) from the `mesh` settings: -1 takes the remaining devices."""
  n = jax.device_count() if n_devices is None else n_devices
  sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ConfigError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
  if any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(f"mesh sizes must be positive or -1; got data={sizes[0]}, "
                     f"fsdp={sizes[1]}, tensor={sizes[2]}")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if n % fixed:
      raise ConfigError(f"{n} devices are not divisible by the fixed mesh sizes (product {fixed})")
    sizes[free[0]] = n // fixed
  if math.prod(sizes) != n:
    raise ConfigError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = "
                     f"{math.prod(sizes)} devices, but {n} are available")
  return tuple(sizes)


def mesh_sizes(mesh_cfg, n_devices: int | None = None) -> dict:
  """{axis: size} over MESH_AXES: mesh_shape's data split into mesh.slices x data per
  slice. Raises ConfigError where the slices do not divide the data axis (FSDP and
  tensor groups stay whole inside a slice)."""
  data, fsdp, tensor = mesh_shape(mesh_cfg, n_devices)
  slices = mesh_cfg.slices
  if not isinstance(slices, int) or slices < 1:
    raise ConfigError(f"mesh.slices={slices!r}: expected a whole number of TPU slices >= 1")
  if data % slices:
    raise ConfigError(
        f"mesh.slices={slices} must divide mesh.data={data} (the data replicas of all "
        "slices): only data replicas span slices, FSDP and tensor groups stay inside one "
        f"(their collectives run every layer); here fsdp={fsdp}, tensor={tensor}")
  return dict(zip(MESH_AXES, (slices, data // slices, fsdp, tensor)))


def slice_groups(devices, slices: int) -> list[list]:
  """The devices of each slice: by `slice_index` on TPU; elsewhere by process (several
  processes to a slice where there are more), or in order within one process (the
  tests' stand-in for slices)."""
  devices = list(devices)
  if devices[0].platform == "tpu":  # CPU devices of several processes say slice 0
    key = lambda d: d.slice_index  # noqa: E731
  else:
    procs = sorted({d.process_index for d in devices})
    if len(procs) > 1:
      if len(procs) % slices:
        raise ConfigError(f"mesh.slices={slices} does not divide the run's {len(procs)} "
                          "processes: a slice is a whole number of hosts")
      key = lambda d: procs.index(d.process_index) * slices // len(procs)  # noqa: E731
    else:
      key = lambda d: devices.index(d) * slices // len(devices)  # noqa: E731
  groups = {}
  for d in devices:
    groups.setdefault(key(d), []).append(d)
  if len(groups) != slices or len({len(g) for g in groups.values()}) != 1:
    raise ConfigError(f"mesh.slices={slices}, but the devices form {len(groups)} slices of "
                      f"{sorted(len(g) for g in groups.values())} devices")
  return [groups[k] for k in sorted(groups)]


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
  devices = jax.devices() if devices is None else devices
  sizes = mesh_sizes(mesh_cfg, len(devices))
  shape = tuple(sizes.values())
  # Auto axes: sharding propagates through plain gathers (Explicit axes would
  # demand an out_sharding on every lookup).
  types = (AxisType.Auto,) * len(MESH_AXES)
  if sizes["slice"] == 1:
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
  # Each slice laid out over its own chips, the slices stacked outermost: the layout of
  # mesh_utils.create_hybrid_device_mesh, which groups by TPU slice or by process only.
  grid = np.concatenate([mesh_utils.create_device_mesh((1, *shape[1:]), group)
                         for group in slice_groups(devices, sizes["slice"])], axis=0)
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=types)


def _manual(mesh) -> tuple:
  """The axes a shard_map around this code has made manual (none outside one)."""
  return tuple(getattr(mesh, "manual_axes", ()))


def in_shard_map() -> bool:
  """Whether this is traced inside a shard_map over part of the mesh (the data-parallel
  step's): there XLA's partitioner fails a check partitioning a gather from an array
  split over both other axes (data x fsdp x tensor), so gathers take other forms."""
  return bool(_manual(jax.sharding.get_abstract_mesh()))


def free_axes(mesh) -> set:
  """The mesh axes a shard_map here may take: those no enclosing shard_map has."""
  return set(mesh.axis_names) - set(_manual(mesh))


def logical_to_spec(logical, shape, mesh) -> P:
  """Mesh axes for a parameter; an axis that does not divide stays replicated, and so
  does one a shard_map around the caller has taken (its shards are already local)."""
  spec, used = [], set(_manual(mesh))
  for name, dim in zip(logical or (), shape):
    axes = RULES.get(name)
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    if axes and dim % size == 0:
      spec.append(axes[0] if len(axes) == 1 else axes)
      used.update(axes)
    else:
      spec.append(None)
  return P(*spec)


def param_specs(abstract_state, mesh):
  """PartitionSpecs for a model's nnx.State (abstract or real), as a pure dict."""
  from flax import nnx
  specs = {}
  for path, var in nnx.to_flat_state(abstract_state):
    logical = var.get_metadata().get("logical", ())
    specs[path] = logical_to_spec(logical, var.shape, mesh)
  out = {}
  for path, spec in specs.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = spec
  return out


def constrain(x, logical):
  """x with its dimensions split as RULES and the batch axes say (activations: "batch"
  is the rows' axes), under the current mesh; a no-op without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical, x.shape, mesh))


def named(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh, leading_dims: int = 1) -> NamedSharding:
  """Rows split over data x fsdp; `leading_dims` axes before the rows stay whole."""
  return NamedSharding(mesh, P(*([None] * (leading_dims - 1)), BATCH_AXES))


def global_batch(local: np.ndarray, mesh, leading_dims: int = 1):
  """A global array from each process's rows (multi-host: every process calls this)."""
  return jax.make_array_from_process_local_data(batch_sharding(mesh, leading_dims), local)


def axes_of(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def batch_axes(mesh, batch: int) -> tuple:
  """The mesh axes a batch of this many rows is split over: the batch axes of size > 1,
  or none when the batch does not divide (decoding one sequence)."""
  axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1 and a not in _manual(mesh))
  return axes if batch % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def batch_shards(batch: int) -> int:
  """How many ways the current mesh splits a batch of this many rows (1 off a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else math.prod(mesh.shape[a] for a in batch_axes(mesh, batch))


def shards(logical: str) -> int:
  """How many ways the current mesh splits a dimension of this logical axis that
  divides (1 off a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = axes_of(RULES[logical])
  return math.prod(mesh.shape.get(a, 1) for a in axes if a not in _manual(mesh))


def param_specs_of(shardings):
  return jax.tree.map(lambda s: s.spec, shardings,
                      is_leaf=lambda x: isinstance(x, NamedSharding))
