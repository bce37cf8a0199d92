"""Decoding speed and cache memory, the baseline against the config's value mode.

  python -m benchmarks.decode --config=FILE --contexts=256,1024 [--batch=B] [--steps=N] [--json]

For each context length, a prompt fills the cache up to `context - steps` positions
(`inference.prefill`), then `steps` greedy decode steps run (`inference.decode`,
the loop `generate` runs) and are timed after a compile. Reports the cache's
allocated bytes, how many bank layers keep no values, and decode tokens/s.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from absl import logging
from flax import nnx

from benchmarks import common
from bov_jax import cli
from bov_jax.inference import generate as inference
from bov_jax.kernels import bank_decode
from bov_jax.model import initialize
from bov_jax.model import kvcache
from bov_jax.run import spec as spec_lib
from bov_jax.settings import values

_CONTEXTS = flags.DEFINE_string("contexts", "256,1024", "Context lengths.")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences decoded together.")
_STEPS = flags.DEFINE_integer("steps", 10, "Decode steps per context.")


def bench_decode(cfg, contexts, batch: int, steps: int) -> list[dict]:
  """A record per (value mode, context): gpt_base, then the config's mode."""
  out = []
  mode = spec_lib.resolve(cfg).model.value
  modes = [values.ValueMode(preset="gpt_base")] + ([] if mode.is_baseline else [mode])
  for m in modes:
    for context in contexts:
      c = cfg.copy_and_resolve_references()
      c.model.sequence_len = max(c.model.sequence_len, context)  # windows follow it
      ms = bank_decode.resolve(dataclasses.replace(spec_lib.resolve(c).model, value=m))
      model = initialize.init(ms, jax.random.key(0))
      graphdef, params = nnx.split(model)
      n = min(steps, context - 1)
      lengths = jnp.full((batch,), context - n, jnp.int32)
      prompts = jax.random.randint(jax.random.key(2), (batch, context - n), 0, ms.vocab_size)
      prefill = jax.jit(lambda p, x: inference.prefill(nnx.merge(graphdef, p), x, lengths, context))
      decode = jax.jit(lambda p, last, cache: inference.decode(
          nnx.merge(graphdef, p), last, cache, jax.random.key(0), n))
      last, cache = prefill(params, prompts)
      jax.block_until_ready(decode(params, last, cache))  # compile
      t = time.perf_counter()
      jax.block_until_ready(decode(params, last, cache))
      dt = time.perf_counter() - t
      out.append({"bench": "decode", "preset": m.preset or m.describe(), "context": context,
                  "batch": batch, "cache_bytes": kvcache.nbytes(cache),
                  "n_bank_layers": sum(layer_value.is_bank for layer_value in ms.layers),
                  "kv_dim": ms.n_kv_head * ms.head_dim,
                  "bytes_per_element": jnp.dtype(ms.dtype).itemsize,
                  "decode_steps": n, "tokens_per_s": batch * n / dt})
  return out


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  contexts = [int(c) for c in _CONTEXTS.value.split(",") if c.strip()]
  common.spec_from_flags()  # checks the config
  for rec in bench_decode(common.CONFIG.value, contexts, _BATCH.value, _STEPS.value):
    common.emit(rec)


if __name__ == "__main__":
  from bov_jax.host import hugepages
  hugepages.reexec_with_huge_pages()  # as bov_jax.main does on CPU: see hugepages.py
  cli.run(main)  # a missing extra: one line, exit 1
