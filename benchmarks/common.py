"""What the benchmarks share: the flags every one takes, the output line, and the real
train step on random tokens."""

from __future__ import annotations

import json
import statistics
import time

import jax
from absl import flags
from ml_collections import config_flags

from bov_jax.parallel import sharding
from bov_jax.run import plan
from bov_jax.run import spec as spec_lib
from bov_jax.store import metrics
from bov_jax.training import step as step_lib

CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file.")
JSON = flags.DEFINE_bool("json", False, "Print JSON lines only.")


def spec_from_flags() -> spec_lib.RunSpec:
  if CONFIG.value is None:
    raise ValueError("--config=FILE is required (for example configs/tiny.py)")
  return spec_lib.resolve(CONFIG.value)


def emit(obj) -> None:
  print(json.dumps(obj) if JSON.value else "  ".join(f"{k}={v}" for k, v in obj.items()),
        flush=True)


class TrainStep:
  """The run's compiled train step (its optimizer, accumulation and shardings, from
  `step.build`) on random tokens; `run()` does one step and returns its seconds."""

  def __init__(self, spec: spec_lib.RunSpec):
    self.spec = spec
    self.mesh = sharding.make_mesh(spec.mesh)
    self.trainer = step_lib.build(spec, self.mesh, num_iterations=1000, key=jax.random.key(0))
    L = self.trainer.layout
    rows = L.rows_per_device * jax.device_count()
    T = spec.model.sequence_len
    bsh = sharding.batch_sharding(self.mesh, leading_dims=2)
    tokens = jax.random.randint(jax.random.key(1), (L.accum, rows, T + 1), 0,
                                spec.model.vocab_size)
    self.batch = (jax.device_put(tokens[..., :-1], bsh), jax.device_put(tokens[..., 1:], bsh))
    self.state = [self.trainer.params, self.trainer.opt_state]

  def run(self) -> float:
    with jax.set_mesh(self.mesh):
      t = time.perf_counter()
      self.state[0], self.state[1], out = self.trainer.train_step(*self.state, *self.batch)
      jax.block_until_ready(out)
      return time.perf_counter() - t

  def compiled_text(self) -> str:
    with jax.set_mesh(self.mesh):
      return self.trainer.train_step.lower(*self.state, *self.batch).compile().as_text()

  def record(self) -> dict:
    spec = self.spec
    return {"preset": spec.model.value.preset, "devices": jax.device_count(),
            "platform": jax.devices()[0].platform, "tokens_per_step": spec.train.batch_tokens,
            "flops_per_token": plan.flops_per_token(spec.model)}


def peak_flops() -> float:
  return metrics.peak_flops() * jax.device_count()


def time_interleaved(runs: dict, steps: int, warmup: int, block: int = 5) -> dict:
  """Median seconds of each run() over `steps` timed steps. The runs take turns in
  blocks of `block` steps, each block after one untimed step: a noisy host's slow
  minutes fall on all of them alike, and each is timed in its own steady state
  (caches and allocator warm from its own previous step, not the other's)."""
  for _ in range(warmup):
    for run in runs.values():
      run()
  times = {name: [] for name in runs}
  while any(len(ts) < steps for ts in times.values()):
    for name, run in runs.items():
      run()
      times[name] += [run() for _ in range(min(block, steps - len(times[name])))]
  return {name: statistics.median(ts) for name, ts in times.items()}
