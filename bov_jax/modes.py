"""`--mode=eval` and `--mode=sample`: a trained run's latest checkpoint, evaluated or
continued. Both read the run directory's config and tokenizer; neither builds an
optimizer.
"""

from __future__ import annotations

import json

import jax
from flax import nnx

from bov_jax import bpb
from bov_jax import checkpoint as ckpt_lib
from bov_jax import config as config_lib
from bov_jax import inference
from bov_jax import model as model_lib
from bov_jax import run as run_lib
from bov_jax import sharding
from bov_jax import step as step_lib
from bov_jax.kernels import bank_decode
from bov_jax.run import log


def restore(spec, workdir: str, mesh):
  """(step, graphdef, params) of WORKDIR's newest readable checkpoint, sharded on the mesh."""
  graphdef, abstract, _ = step_lib.abstract_params(spec, mesh)
  restored = ckpt_lib.Checkpoints(workdir, async_save=False).restore(abstract, log=log)
  if restored is None:
    raise FileNotFoundError(f"no checkpoint under {ckpt_lib.checkpoint_dir(workdir)}")
  return restored.step, graphdef, restored.params


def run_core(spec, graphdef, params, tok) -> dict:
  from bov_jax import core
  return core.core(spec.eval.core_bundle, graphdef, params, tok, spec.eval.core_max_per_task,
                   spec.eval.core_config, log=log)


def evaluate(spec, workdir: str) -> dict:
  """Validation bpb of WORKDIR's latest checkpoint, or its CORE with eval.core_bundle;
  also written to WORKDIR/eval.json or core.json."""
  mesh = sharding.make_mesh(spec.mesh)
  tok = run_lib.tokenizer(spec, workdir)
  with jax.set_mesh(mesh):
    step, graphdef, params = restore(spec, workdir, mesh)
    if spec.eval.core_bundle:
      result, name = {"step": int(step), **run_core(spec, graphdef, params, tok)}, "core.json"
    else:
      _, val_split = run_lib.documents(spec)
      rows = step_lib.batch_layout(spec).local_rows
      evaluator = bpb.Evaluator(spec, mesh, jax.jit(step_lib.make_eval_step(graphdef)),
                                val_split, tok, rows)
      result, name = {"step": int(step), "val_bpb": evaluator(params)}, "eval.json"
  if run_lib.is_main():
    (ckpt_lib.path(workdir) / name).write_text(json.dumps(result))
  return result


def sample(spec, workdir: str) -> dict:
  """Text from WORKDIR's latest checkpoint (sample.* settings); {"tokens": [...]}."""
  s = spec.sample
  mesh = sharding.make_mesh(spec.mesh)
  tok = run_lib.tokenizer(spec, workdir)
  prompt = tok.encode(s.prompt)
  context = spec.model.sequence_len
  if len(prompt) >= context:
    raise config_lib.ConfigError(f"sample.prompt is {len(prompt)} tokens; the context is "
                                 f"{context}")
  with jax.set_mesh(mesh):
    _, graphdef, params = restore(spec, workdir, mesh)
    if s.use_cache:  # whether a bank layer decodes in the fused kernel: decided here, once
      graphdef = nnx.graphdef(model_lib.abstract(bank_decode.resolve(spec.model)))
    if s.tables_on_host:
      graphdef, params = inference.tables_to_host(graphdef, params)
    gen = inference.generate_cached if s.use_cache else inference.generate_uncached
    ids = gen(graphdef, params, prompt, s.max_new_tokens, context, s.temperature, s.top_k, s.seed)
  log(tok.decode(prompt[1:] + ids))
  return {"tokens": ids}
