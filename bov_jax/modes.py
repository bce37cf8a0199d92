"""The modes that do not train: `--mode=plan` (what a run costs), `--mode=compile` (its
programs compiled for a TPU slice), `--mode=eval` and `--mode=sample` (a trained run's
latest checkpoint, evaluated or continued; both read the run directory's config and
tokenizer, neither builds an optimizer). Each prints its result as one JSON line and
returns the process's exit code.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from etils import epath

from bov_jax import bpb
from bov_jax import checkpoint as ckpt_lib
from bov_jax import config as config_lib
from bov_jax import inference
from bov_jax import process
from bov_jax import rundir
from bov_jax import sharding
from bov_jax import step as step_lib
from bov_jax.process import log


def _print_json(obj) -> None:
  print(json.dumps(obj), flush=True)


def plan(spec) -> int:
  """--mode=plan: parameters, FLOPs, the step budget and memory, computed instantly."""
  from bov_jax import plan as plan_lib
  _print_json(plan_lib.make_plan(spec))
  return 0


def compile_for(cfg, topology: str | None, programs) -> int:
  """--mode=compile: the run's programs compiled for a TPU slice on this host; exit 0
  when all fit, 1 when one does not, 2 on bad input (raised as ValueError)."""
  from bov_jax import aot
  from bov_jax import spec as spec_lib
  if not topology:
    raise ValueError("--mode=compile needs --topology=NAME (a TPU slice such as v5p-64; known: "
                     + ", ".join(aot.known_topologies()) + ")")
  jax.config.update("jax_enable_compilation_cache", False)  # compile_s is a real compile
  try:
    report = aot.run(spec_lib.resolve(cfg, backend="tpu"), topology, programs)
  except aot.TopologyError as e:
    raise ValueError(str(e)) from None
  if not report["fits"]:
    print(f"error: {aot.overflow_message(report)}", file=sys.stderr)
  _print_json(report)
  return 0 if report["fits"] else 1


def evaluate_or_sample(mode: str, spec, cfg, workdir: str) -> int:
  """--mode=eval or --mode=sample on WORKDIR, once its config of record is known to
  restore into `cfg`."""
  rundir.check_config(workdir, cfg)  # refuses what cannot restore
  _print_json(evaluate(spec, workdir) if mode == "eval" else sample(spec, workdir))
  return 0


def restore(spec, workdir: str, mesh):
  """(step, graphdef, params) of WORKDIR's newest readable checkpoint, sharded on the mesh;
  or of an exported folder's weights (export.py)."""
  graphdef, abstract, shardings = step_lib.abstract_params(spec, mesh)
  if rundir.is_export(workdir):
    from bov_jax import export
    params = export.read_weights(workdir)
    step = json.loads((epath.Path(workdir) / rundir.EXPORT_CONFIG).read_text()).get("step", 0)
    return step, graphdef, jax.tree.map(
        lambda a, x, s: jax.device_put(np.asarray(x, a.dtype), s), abstract, params, shardings)
  restored = ckpt_lib.Checkpoints(workdir, async_save=False).restore(abstract, log=log)
  if restored is None:
    raise FileNotFoundError(f"no checkpoint under {rundir.checkpoints(workdir)}")
  return restored.step, graphdef, restored.params


def run_core(spec, graphdef, params, tok) -> dict:
  from bov_jax import core
  return core.core(spec.eval.core_bundle, graphdef, params, tok, spec.eval.core_max_per_task,
                   spec.eval.core_config, log=log)


def evaluate(spec, workdir: str) -> dict:
  """Validation bpb of WORKDIR's latest checkpoint, or its CORE with eval.core_bundle;
  also written to WORKDIR/eval.json or core.json."""
  mesh = sharding.make_mesh(spec.mesh)
  tok = process.tokenizer(spec, workdir)
  with jax.set_mesh(mesh):
    step, graphdef, params = restore(spec, workdir, mesh)
    if spec.eval.core_bundle:
      result, name = {"step": int(step), **run_core(spec, graphdef, params, tok)}, rundir.CORE
    else:
      _, val_split = process.documents(spec)
      rows = step_lib.batch_layout(spec).local_rows
      evaluator = bpb.Evaluator(spec, mesh, jax.jit(step_lib.make_eval_step(graphdef)),
                                val_split, tok, rows)
      result, name = {"step": int(step), "val_bpb": evaluator(params)}, rundir.EVAL
  if process.is_main():
    rundir.write_result(workdir, name, result)
  return result


def sample(spec, workdir: str) -> dict:
  """Text from WORKDIR's latest checkpoint (sample.* settings); {"tokens": [...]}."""
  s = spec.sample
  mesh = sharding.make_mesh(spec.mesh)
  tok = process.tokenizer(spec, workdir)
  prompt = tok.encode(s.prompt)
  context = spec.model.sequence_len
  if (why := inference.prompt_too_long(len(prompt), context)) is not None:
    raise config_lib.ConfigError(why)
  with jax.set_mesh(mesh):
    _, graphdef, params = restore(spec, workdir, mesh)
    if s.use_cache:  # whether a bank layer decodes in the fused kernel: decided here, once
      graphdef = inference.decoding_graphdef(spec.model)
    if s.tables_on_host:
      graphdef, params = inference.tables_to_host(graphdef, params)
    gen = inference.generate_cached if s.use_cache else inference.generate_uncached
    ids = gen(graphdef, params, prompt, s.max_new_tokens, context, s.temperature, s.top_k, s.seed)
  log(tok.decode(prompt[1:] + ids))
  return {"tokens": ids}
