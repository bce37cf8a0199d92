"""A training run's profile: log.profile_steps steps from log.profile_start_step traced
with jax.profiler into the run directory's profile/ (an .xplane.pb under
plugins/profile/, what TensorBoard's profile plugin, XProf, reads; and a Perfetto
trace), as MaxText's `profiler=xplane` with `skip_first_n_steps_for_profiler`. On
process 0 only, after the step has compiled; a run directory in a bucket is traced on
the local disk and copied up when the trace ends.
"""

from __future__ import annotations

import os
import tempfile

import jax

from bov_jax.store import rundir
from bov_jax.store import storage


class Profiler:

  def __init__(self, workdir: str | None, start_step: int, steps: int):
    self.first, self.last = start_step, start_step + steps - 1  # the steps traced
    self.on = bool(workdir) and steps > 0 and jax.process_index() == 0
    self.dest = rundir.profile(workdir) if workdir else None
    self.local = None  # the directory being written while a trace runs

  def due(self, step: int) -> bool:
    """After step `step`: the trace starts (before step first) or ends (after last)."""
    return self.on and step in (self.first - 1, self.last)

  def after(self, step: int, sync) -> None:
    """Starts the trace before step `first`, or ends it after step `last` (`sync()`
    waits for the device to finish that step)."""
    if step == self.first - 1:
      self.local = (tempfile.mkdtemp(prefix="bov_jax_profile_")
                    if storage.is_remote(self.dest) else self.dest)
      os.makedirs(self.local, exist_ok=True)
      jax.profiler.start_trace(self.local, create_perfetto_trace=True)
    else:
      self.close(sync)

  def close(self, sync) -> None:
    """Ends a trace still running (a run that stopped inside its steps), and copies it up."""
    if self.local is None:
      return
    sync()
    jax.profiler.stop_trace()
    if self.local != self.dest:
      fs, path = storage.filesystem(self.dest)
      fs.put(self.local.rstrip("/") + "/", path, recursive=True)
    self.local = None
