"""An engine for a finished run directory or an exported folder, on this host's first
device: the config of record resolved once, the newest weights, the run's tokenizer."""

from __future__ import annotations

import os

import jax
from flax import nnx

from bov_jax.data import sources
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.run import spec as spec_lib
from bov_jax.serving import engine as engine_lib
from bov_jax.store import rundir


def engine(workdir: str, slots: int, page_size: int, cache_bytes: int | None,
           max_queue: int, decode_steps: int = engine_lib.DECODE_STEPS
           ) -> tuple[engine_lib.Engine, str]:
  """(the engine, not started; the model's name: the folder's)."""
  spec = spec_lib.resolve(rundir.config_of(workdir), n_devices=1)
  mesh = sharding.make_mesh(spec.mesh, jax.devices()[:1])
  tok = sources.tokenizer(spec, workdir)
  with jax.set_mesh(mesh):
    _, graphdef, params = params_lib.restore(spec, workdir, mesh)
  model = nnx.merge(graphdef, params)
  limits = engine_lib.limits_for(model, spec.model.sequence_len, slots, page_size, cache_bytes,
                                 max_queue, decode_steps)
  name = os.path.basename(os.path.normpath(workdir)) or "bov"
  return engine_lib.Engine(graphdef, params, tok, limits), name

