"""`python -m bov_jax.main`'s modes: `--mode=train` (training/train.py), `--mode=plan`
(what a run costs), `--mode=compile` (its programs compiled for a TPU slice),
`--mode=eval` and `--mode=sample` (a trained run's latest checkpoint, evaluated or
continued; both read the run directory's config and tokenizer, neither builds an
optimizer). The modes that do not train print their result as one JSON line; each
returns the process's exit code.
"""

from __future__ import annotations

import json
import sys

import jax
from flax import nnx

from bov_jax.data import sources
from bov_jax.evaluation import bpb
from bov_jax.evaluation import core
from bov_jax.host import process
from bov_jax.host.process import log
from bov_jax.inference import generate as inference
from bov_jax.model import gpt as model_lib
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.parallel import topology as topology_lib
from bov_jax.run import plan
from bov_jax.run import spec as spec_lib
from bov_jax.settings import config as config_lib
from bov_jax.store import checkpoint as ckpt_lib
from bov_jax.store import rundir
from bov_jax.training import aot
from bov_jax.training import step as step_lib
from bov_jax.training import train

# What a run that failed raises (exit 1 with its one error line).
RUN_FAILED = (train.TrainError, ckpt_lib.CorruptCheckpointError)


def _print_json(obj) -> None:
  print(json.dumps(obj), flush=True)


def run(mode: str, cfg, workdir: str | None, topology: str | None = None,
        programs=("train", "eval", "decode"), dcn_gbps: float = plan.DCN_GBPS) -> int:
  """`python -m bov_jax.main --mode=MODE`: the mode run on `cfg`; returns 0, 1 for a
  program that does not fit (compile), or train.PREEMPTED_EXIT for a run stopped by a
  preemption. Raises ValueError or OSError for bad input or a failed environment, one of
  RUN_FAILED for a run that failed (a missing optional extra: MissingExtra, which the
  command line reports as cli.run does)."""
  if mode == "compile":
    return compile_for(cfg, topology, programs)
  if mode == "plan":  # for the devices the mesh settings or --topology name, not this host's
    return print_plan(cfg, topology, dcn_gbps)
  spec = spec_lib.resolve(cfg, n_devices=jax.device_count())
  if mode != "train" and not workdir:
    raise ValueError(f"--mode={mode} needs --workdir=DIR holding a run's checkpoint")
  process.use_compile_cache(spec.train.compile_cache_dir)
  if mode == "train":
    return train.PREEMPTED_EXIT if train.train(spec, workdir).get("preempted") else 0
  return evaluate_or_sample(mode, spec, cfg, workdir)


def print_plan(cfg, topology: str | None = None, dcn_gbps: float = plan.DCN_GBPS) -> int:
  """--mode=plan: parameters, FLOPs, the step budget and memory, computed instantly; for
  --topology's chips where given (2xv5p-64, or v5p-64 with mesh.slices), with what
  crosses slices at `dcn_gbps` against the step's compute at the chips' peak."""
  peak = None
  if topology:
    try:
      cfg, name = aot.target(cfg, topology)
      chip, chips, _ = topology_lib.parse_topology(name)
    except topology_lib.TopologyError as e:
      raise ValueError(str(e)) from None
    spec = spec_lib.resolve(cfg, backend="tpu", n_devices=chips * cfg.mesh.slices)
    peak = chip.peak_flops
  else:
    spec = spec_lib.resolve(cfg)
  if dcn_gbps <= 0:
    raise ValueError(f"--dcn_gbps={dcn_gbps}: expected the network's Gbit/s a chip, > 0")
  _print_json(plan.make_plan(spec, peak, dcn_gbps))
  return 0


def compile_for(cfg, topology: str | None, programs) -> int:
  """--mode=compile: the run's programs compiled for a TPU slice on this host; exit 0
  when all fit, 1 when one does not, 2 on bad input (raised as ValueError)."""
  if not topology:
    raise ValueError("--mode=compile needs --topology=NAME (a TPU slice such as v5p-64; known: "
                     + ", ".join(topology_lib.known_topologies()) + ")")
  jax.config.update("jax_enable_compilation_cache", False)  # compile_s is a real compile
  try:
    report = aot.run(aot.spec_for(cfg, topology), topology, programs)
  except topology_lib.TopologyError as e:
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


def evaluate(spec, workdir: str) -> dict:
  """Validation bpb of WORKDIR's latest checkpoint, or its CORE with eval.core_bundle;
  also written to WORKDIR/eval.json or core.json."""
  mesh = sharding.make_mesh(spec.mesh)
  tok = sources.tokenizer(spec, workdir)
  with jax.set_mesh(mesh):
    step, graphdef, params = params_lib.restore(spec, workdir, mesh)
    if spec.eval.core_bundle:
      result, name = {"step": int(step), **core.run(spec, graphdef, params, tok)}, rundir.CORE
    else:
      _, val_split = sources.documents(spec)
      evaluator = bpb.Evaluator(spec, mesh, jax.jit(step_lib.make_eval_step(graphdef)),
                                val_split, tok, spec.batch.local_rows)
      result, name = {"step": int(step), "val_bpb": evaluator(params)}, rundir.EVAL
  if process.is_main():
    rundir.write_result(workdir, name, result)
  return result


def sample(spec, workdir: str) -> dict:
  """Text from WORKDIR's latest checkpoint (sample.* settings); {"tokens": [...]}."""
  s = spec.sample
  mesh = sharding.make_mesh(spec.mesh)
  tok = sources.tokenizer(spec, workdir)
  prompt = tok.encode(s.prompt)
  context = spec.model.sequence_len
  if (why := inference.prompt_too_long(len(prompt), context)) is not None:
    raise config_lib.ConfigError(why)
  with jax.set_mesh(mesh):
    _, graphdef, params = params_lib.restore(spec, workdir, mesh)
    if s.tables_on_host:  # the model as sampling runs it: its tables read from host memory
      graphdef, params = nnx.graphdef(model_lib.abstract(spec.sample_model)), \
          inference.tables_to_host(params)
    gen = inference.generate_cached if s.use_cache else inference.generate_uncached
    ids = gen(graphdef, params, prompt, s.max_new_tokens, context, s.temperature, s.top_k, s.seed)
  log(tok.decode(prompt[1:] + ids))
  return {"tokens": ids}
