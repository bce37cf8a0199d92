"""The device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters
and optimizer state split), `tensor` (within-layer model parallel). Every
parameter names its axes in model.py (`logical=`); RULES says where each goes.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (or axes), MaxText style.
RULES = {
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "table_vocab": ("fsdp", "tensor"),
}


def mesh_shape(cfg, n_devices: int | None = None) -> tuple[int, int, int]:
  n = jax.device_count() if n_devices is None else n_devices
  sizes = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ValueError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh sizes must be positive or -1; got data={sizes[0]}, "
                     f"fsdp={sizes[1]}, tensor={sizes[2]}")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if n % fixed:
      raise ValueError(f"{n} devices are not divisible by the fixed mesh sizes (product {fixed})")
    sizes[free[0]] = n // fixed
  if math.prod(sizes) != n:
    raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = "
                     f"{math.prod(sizes)} devices, but {n} are available")
  return tuple(sizes)


def make_mesh(cfg, devices=None) -> jax.sharding.Mesh:
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(cfg, len(devices))
  # Auto axes: sharding propagates through plain gathers (Explicit axes would
  # demand an out_sharding on every lookup).
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(logical, shape, mesh) -> P:
  """Mesh axes for a parameter; an axis that does not divide stays replicated."""
  spec, used = [], set()
  for name, dim in zip(logical or (), shape):
    axes = RULES.get(name)
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
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


def named(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh, leading_dims: int = 1) -> NamedSharding:
  """Rows split over data x fsdp; `leading_dims` axes before the rows stay whole."""
  return NamedSharding(mesh, P(*([None] * (leading_dims - 1)), BATCH_AXES))


def global_batch(local: np.ndarray, mesh, leading_dims: int = 1):
  """A global array from each process's rows (multi-host: every process calls this)."""
  return jax.make_array_from_process_local_data(batch_sharding(mesh, leading_dims), local)
