"""A scalar summed over a batch's rows, each device summing its own rows and the sums
reduced once."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from bov_jax.parallel.sharding import batch_axes


def sum_over_rows(fn, rows, shared):
  """fn(*rows, *shared), a scalar summed over the rows' leading (batch) axis. Where the
  mesh splits that axis, each device runs fn on its own rows with `shared` whole (a
  shard_map over the batch axes) and the sums are added: each device's contribution to
  a shared input's gradient is then reduced once, not after every step of fn's loops
  (the LM head's gradient under FSDP, after every loss chunk)."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else batch_axes(mesh, rows[0].shape[0])
  if not axes:
    return fn(*rows, *shared)
  body = lambda *args: jax.lax.psum(fn(*args), axes)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * len(rows) + (P(),) * len(shared),
                       out_specs=P(), axis_names=set(axes), check_vma=False)(*rows, *shared)
