"""The train step's speed.

  python -m benchmarks.train --config=FILE [--json] [--steps=N] [--warmup=N]
      [--profile=DIR] [--reference=torch|torch_compiled] [--config.k=v ...]

Compiles the real train step once (random tokens, the config's optimizer and
accumulation), times warm steps and reports the median. With --reference=torch the
PyTorch transcription's steps (benchmarks/torch_reference.py) alternate with ours in
blocks (eager); --reference=torch_compiled runs it as the reference trains, under
torch.compile (needs a C++ compiler). --profile traces one more step with
jax.profiler into DIR and prints where its time went.
"""

from __future__ import annotations

import sys

import jax
from absl import app
from absl import flags
from absl import logging

from benchmarks import common
from benchmarks import profile as profile_lib
from bov_jax import cli
from bov_jax.host import extras

_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
_PROFILE = flags.DEFINE_string("profile", None, "After timing, trace one more step with "
                               "jax.profiler into this folder (TensorBoard/XProf, and a "
                               "Perfetto JSON).")
_REFERENCE = flags.DEFINE_enum("reference", None, ["torch", "torch_compiled"],
                               "Also time the PyTorch transcription (needs torch), eager or "
                               "under torch.compile.")


def bench_train(spec, steps: int, warmup: int, reference: str | None = None,
                profile: str | None = None) -> list[dict]:
  """The train record (last), after the reference's record when one is asked for."""
  stepper = common.TrainStep(spec)
  rec = {"bench": "train", **stepper.record(), "compile_s": stepper.run(),
         "peak_flops": common.peak_flops()}
  runs = {"bov_jax": stepper.run}
  if reference is not None:
    extras.require("torch", "torch", "--reference (the PyTorch reference step)")
    from benchmarks import torch_reference
    runs["torch"], ref = torch_reference.make_step(spec, compiled=reference == "torch_compiled")
  dt = common.time_interleaved(runs, steps, warmup)
  if profile:
    with jax.profiler.trace(profile, create_perfetto_trace=True):
      stepper.run()
    hlo = stepper.compiled_text() if jax.devices()[0].platform == "cpu" else None
    print(profile_lib.profile_summary(profile, hlo_text=hlo), file=sys.stderr, flush=True)
  tps = spec.train.batch_tokens / dt["bov_jax"]
  rec.update(step_s=dt["bov_jax"], tokens_per_s=tps, achieved_flops=tps * rec["flops_per_token"],
             mfu=tps * rec["flops_per_token"] / rec["peak_flops"])
  if reference is None:
    return [rec]
  ref.update(step_s=dt["torch"], tokens_per_s=ref["tokens_per_step"] / dt["torch"])
  rec.update(reference_tokens_per_s=ref["tokens_per_s"],
             speedup_vs_reference=rec["tokens_per_s"] / ref["tokens_per_s"])
  return [ref, rec]


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for rec in bench_train(common.spec_from_flags(), _STEPS.value, _WARMUP.value,
                         _REFERENCE.value, _PROFILE.value):
    common.emit(rec)


if __name__ == "__main__":
  from bov_jax.host import hugepages
  hugepages.reexec_with_huge_pages()  # as bov_jax.main does on CPU: see hugepages.py
  cli.run(main)  # a missing extra: one line, exit 1
