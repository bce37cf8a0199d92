"""Benchmarks (timing claims live here, never in tests).

  python -m bov_jax.bench train  --config=FILE [--json] [--steps=N] [--config.k=v ...]
  python -m bov_jax.bench decode --config=FILE --contexts=256,1024 [--batch=B] [--json]

`train` compiles the real train step once (random tokens, the config's
optimizer and accumulation), times warm steps and reports the median.
`decode` builds the baseline (gpt_base) and the config's value mode at each
context length and reports the cache's allocated bytes and decode throughput.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from absl import logging
from flax import nnx
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file.")
_JSON = flags.DEFINE_bool("json", False, "Print JSON lines only.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (train) / decode steps per context.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
_CONTEXTS = flags.DEFINE_string("contexts", "256,1024", "Context lengths (decode).")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences decoded together (decode).")
_REFERENCE = flags.DEFINE_enum("reference", None, ["torch"],
                               "train: also time the PyTorch transcription (needs torch).")


def _emit(obj, as_json):
  print(json.dumps(obj) if as_json else "  ".join(f"{k}={v}" for k, v in obj.items()), flush=True)


def bench_train(cfg, steps: int, warmup: int) -> dict:
  from bov_jax import config as config_lib
  from bov_jax import optim
  from bov_jax import plan
  from bov_jax import sharding
  from bov_jax import train
  config_lib.validate(cfg)
  mesh = sharding.make_mesh(cfg)
  n_dev = jax.device_count()
  per_device = train.micro_batch_rows(cfg, n_dev)
  T = cfg.model.sequence_len
  accum = cfg.train.batch_tokens // (per_device * n_dev * T)
  graphdef, params, _ = train.init_params(cfg, mesh, jax.random.key(0))
  counts = plan.param_counts(cfg)
  fpt = 6 * counts["n_matmul"] + plan.attention_flops(cfg)
  hp = plan.hyperparams(cfg)
  tx = optim.make(cfg, 1000, hp)
  with jax.set_mesh(mesh):
    opt_state = jax.jit(tx.init)(params)
    bsh = sharding.batch_sharding(mesh, leading_dims=2)
    rows = per_device * n_dev
    tokens = jax.random.randint(jax.random.key(1), (accum, rows, T + 1), 0, cfg.model.vocab_size)
    x = jax.device_put(tokens[..., :-1], bsh)
    y = jax.device_put(tokens[..., 1:], bsh)
    step = jax.jit(train.make_train_step(graphdef, tx), donate_argnums=(0, 1))
    t0 = time.perf_counter()
    params, opt_state, out = step(params, opt_state, x, y)
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
      params, opt_state, out = step(params, opt_state, x, y)
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
      t = time.perf_counter()
      params, opt_state, out = step(params, opt_state, x, y)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t)
  dt = statistics.median(times)
  tps = cfg.train.batch_tokens / dt
  peak = plan.peak_flops() * n_dev
  return {"bench": "train", "preset": config_lib.value_mode(cfg).preset, "devices": n_dev,
          "platform": jax.devices()[0].platform, "tokens_per_step": cfg.train.batch_tokens,
          "step_s": dt, "compile_s": compile_s, "tokens_per_s": tps, "flops_per_token": fpt,
          "achieved_flops": tps * fpt, "peak_flops": peak, "mfu": tps * fpt / peak}


def bench_decode(cfg, contexts, batch: int, steps: int) -> list[dict]:
  from bov_jax import config as config_lib
  from bov_jax import inference
  from bov_jax import model as model_lib
  out = []
  mode = config_lib.value_mode(cfg)
  presets = ["gpt_base"] + ([mode.preset or "(config)"] if not mode.is_baseline else [])
  for preset in presets:
    c = cfg.copy_and_resolve_references()
    if preset == "gpt_base":
      c.model.value.preset = "gpt_base"
      for k in ("source", "combine", "coeff", "layers", "shared_table"):
        c.model.value[k] = None
    for context in contexts:
      c.model.sequence_len = max(c.model.sequence_len, context)
      model = model_lib.init_model(c, jax.random.key(0))
      graphdef, state = nnx.split(model)
      params = nnx.to_pure_dict(state)
      n_steps = min(steps, context - 1)
      prompt_len = context - n_steps

      @jax.jit
      def prefill(params, prompts):
        m = nnx.merge(graphdef, params)
        logits, cache = inference.forward_cached(m, prompts, inference.init_cache(m, batch,
                                                                                 context))
        return logits[:, -1], cache

      @jax.jit
      def decode(params, last, cache):
        m = nnx.merge(graphdef, params)

        def body(t, carry):
          last, cache = carry
          tok = jnp.argmax(last, axis=-1).astype(jnp.int32)
          logits, cache = inference.forward_cached(m, tok[:, None], cache)
          return logits[:, 0], cache

        return jax.lax.fori_loop(0, n_steps, body, (last, cache))

      prompts = jax.random.randint(jax.random.key(2), (batch, prompt_len), 0, c.model.vocab_size)
      last, cache = prefill(params, prompts)
      jax.block_until_ready(decode(params, last, cache))  # compile
      t = time.perf_counter()
      jax.block_until_ready(decode(params, last, cache))
      dt = time.perf_counter() - t
      a = model.blocks[0].attn
      out.append({"bench": "decode", "preset": preset, "context": context, "batch": batch,
                  "cache_bytes": inference.cache_bytes(cache),
                  "n_bank_layers": len(inference.bank_layers(model)),
                  "kv_dim": a.n_kv_head * a.head_dim,
                  "bytes_per_element": jnp.dtype(model.compute_dtype).itemsize,
                  "decode_steps": n_steps, "tokens_per_s": batch * n_steps / dt})
  return out


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) != 2 or argv[1] not in ("train", "decode"):
    raise app.UsageError("usage: python -m bov_jax.bench {train|decode} --config=FILE [...]")
  if _CONFIG.value is None:
    raise app.UsageError("--config=FILE is required")
  if argv[1] == "train":
    ours = bench_train(_CONFIG.value, _STEPS.value, _WARMUP.value)
    if _REFERENCE.value == "torch":
      from bov_jax import torch_reference  # imports torch
      ref = torch_reference.bench(_CONFIG.value, _STEPS.value, _WARMUP.value)
      _emit(ref, _JSON.value)
      ours["reference_tokens_per_s"] = ref["tokens_per_s"]
      ours["speedup_vs_reference"] = ours["tokens_per_s"] / ref["tokens_per_s"]
    _emit(ours, _JSON.value)
  else:
    contexts = [int(c) for c in _CONTEXTS.value.split(",") if c.strip()]
    for rec in bench_decode(_CONFIG.value, contexts, _BATCH.value, _STEPS.value):
      _emit(rec, _JSON.value)
  return 0


if __name__ == "__main__":
  from bov_jax import hostmem
  hostmem.reexec_with_huge_pages()  # as bov_jax.main does: see hostmem.py
  app.run(main)
