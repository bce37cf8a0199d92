"""Stopping for a preemption at the same step on every process.

A stop request reaches one host (SIGTERM from the scheduler or `kill`), or on TPU every
host (a maintenance event, through JAX's preemption service). Hosts that acted on their
own signals would stop a step apart and hang in the checkpoint they must write together,
so the decision is collective: after each step every process contributes its flag to a
tiny all-reduce (`max` over one entry per device), dispatched right behind the step and
read with its loss, one step late. Every process reads the same agreed flags at the same
points of the same loop, so all stop after the same step, one or two steps after the
signal. A single process takes the same path.
"""

from __future__ import annotations

import signal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Preemption:

  def __init__(self, mesh):
    self.requested = False  # this process was asked to stop
    try:
      signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread
      pass
    self.sharding = NamedSharding(mesh, P(mesh.axis_names))
    self._agree = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))

  def _handle(self, *_):
    self.requested = True

  def dispatch(self) -> jax.Array:
    """The agreed flag of this step: any process's request (dispatched, not waited for)."""
    local = np.full(jax.local_device_count(), int(self.requested), np.int32)
    return self._agree(jax.make_array_from_process_local_data(self.sharding, local))

  @staticmethod
  def maintenance(step: int) -> bool:
    """JAX's preemption service (TPU maintenance events): the same answer on every host."""
    if jax.process_count() == 1:
      return False
    from jax.experimental import multihost_utils
    return multihost_utils.reached_preemption_sync_point(step)
