"""The model's parameters on a mesh: as shapes with their shardings, created already
sharded, or read from a run's newest checkpoint or an exported folder."""

from __future__ import annotations

import json

import jax
import numpy as np
from etils import epath
from flax import nnx

from bov_jax.host import process
from bov_jax.model import gpt as model_lib
from bov_jax.model import initialize
from bov_jax.parallel import sharding
from bov_jax.store import checkpoint as ckpt_lib
from bov_jax.store import rundir
from bov_jax.store import safetensors


def abstract_params(model_spec, mesh):
  """(graphdef, parameters as ShapeDtypeStructs with their shardings, shardings)."""
  graphdef, abstract = nnx.split(model_lib.abstract(model_spec))
  shardings = sharding.named(mesh, sharding.param_specs(abstract, mesh))
  params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                        nnx.to_pure_dict(abstract), shardings)
  return graphdef, params, shardings


def init_params(model_spec, mesh, key):
  """(graphdef, params, shardings): parameters created already sharded, inside one jit."""
  graphdef, _, shardings = abstract_params(model_spec, mesh)
  with jax.set_mesh(mesh):
    model = initialize.init(model_spec, key, shardings)
  return graphdef, nnx.to_pure_dict(nnx.state(model)), shardings


def placed(loaded: dict, params, where: str):
  """Host arrays `loaded` (the nested dict of an exported folder) placed as `params`
  (arrays or ShapeDtypeStructs with shardings) are; `where` names them in the error
  raised when their names or shapes are not the model's."""
  want, got = safetensors.tensor_names(params), safetensors.tensor_names(loaded)
  bad = sorted(k for k in want if k not in got or got[k].shape != want[k].shape)
  if bad or len(got) != len(want):
    raise safetensors.WeightsError(f"{where}: its weights do not fit this model (differ: "
                                   f"{bad[:5] or sorted(set(got) - set(want))[:5]})")
  return jax.tree.map(lambda p, x: jax.device_put(np.asarray(x, p.dtype), p.sharding),
                      params, loaded)


def restore(spec, workdir: str, mesh):
  """(step, graphdef, params) of WORKDIR's newest readable checkpoint, sharded on the
  mesh; or of an exported folder's weights (interop/export.py)."""
  graphdef, abstract, _ = abstract_params(spec.model, mesh)
  if rundir.is_export(workdir):
    params = placed(safetensors.read_weights(workdir), abstract, f"--workdir={workdir}")
    step = json.loads((epath.Path(workdir) / rundir.EXPORT_CONFIG).read_text()).get("step", 0)
    return step, graphdef, params
  with ckpt_lib.Checkpoints(workdir, async_save=False) as ckpts:
    restored = ckpts.restore(abstract, log=process.log)
  if restored is None:
    raise FileNotFoundError(f"no checkpoint under {rundir.checkpoints(workdir)}")
  return restored.step, graphdef, restored.params
