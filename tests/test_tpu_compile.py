"""--mode=compile: a run's programs compiled by the TPU compiler on this CPU host (libtpu,
installed by the README's set-up on Linux x86-64), so Mosaic compiles the Pallas
kernels (Splash attention, the bank-decode kernel) in every CI run instead of only
running them interpreted."""
import json
import os
import platform
import re
import sys

import pytest

from bov_jax.parallel import topology
from bov_jax.training import aot
from tests.helpers import command
from tests.helpers import small_config


def _libtpu() -> bool:
  try:
    import libtpu  # noqa: F401
    return True
  except ImportError:
    return False


pytestmark = pytest.mark.skipif(
    not _libtpu() and not (sys.platform == "linux" and platform.machine() == "x86_64"),
    reason="libtpu's wheel exists for Linux x86-64 only (pip install '.[tpu]')")


def _config(**mesh):
  """Head dim 128 (the TPU bank-decode kernel's lanes), three layers, the bank in layer 2,
  a 128-token window in a 256-token context."""
  c = small_config("gpt_base_v_from_value_emb_learn", n_layer=3, n_embd=256, n_head=2,
                   n_kv_head=1, sequence_len=256, short_window=128, vocab_size=512)
  # float32: the bank-decode kernel's row DMAs need 32-bit rows (docs/pods.md)
  c.train.batch_tokens = 256 * 8
  c.train.device_batch_size = 2
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh.get("data", -1), mesh.get("fsdp", 1), 1
  return c


def _custom_calls(compiled) -> int:
  return compiled.as_text().count('custom_call_target="tpu_custom_call"')


@pytest.mark.slow
def test_train_step_compiles_with_splash_for_a_tpu():
  """The train step, as step.build makes it, over a v5e-4 split data x fsdp: Splash
  attention (its forward and backward kernels) compiled by Mosaic; the memory figures
  are the compiler's."""
  spec = aot.spec_for(_config(data=2, fsdp=2), "v5e-4")
  assert spec.model.attention == "splash" and not spec.model.splash_interpret
  devices, _ = topology.devices("v5e-4")
  mesh = aot.sharding.make_mesh(spec.mesh, devices)
  layout, lowered = aot.train_programs(spec, mesh)
  assert (layout.rows_per_device, layout.accum) == (2, 1)
  fig, compiled = aot.compile_lowered(lowered["train_step"])
  assert _custom_calls(compiled) >= 3  # Splash's forward, dq and dkv kernels
  assert 0 < fig["argument_bytes"] < fig["peak_bytes"] < aot.GiB
  assert fig["alias_bytes"] > 0  # the donated state is updated in place
  assert fig["compile_s"] > 0


def _dp_config():
  """Data parallel on a v5e-4, two micro-batches of 384 positions (no activation is the
  shape of a parameter or of a stack of them)."""
  cfg = _config(data=4)
  cfg.model.loss_chunk = 128  # several chunks per device
  cfg.model.sequence_len = 384
  cfg.train.batch_tokens, cfg.train.device_batch_size = 384 * 8, 1
  return cfg


def _data_parallel_step(shard_optimizer):
  """A data-parallel train step's compiled HLO."""
  cfg = _dp_config()
  cfg.optim.shard_optimizer = shard_optimizer
  spec = aot.spec_for(cfg, "v5e-4")
  devices, _ = topology.devices("v5e-4")
  layout, lowered = aot.train_programs(spec, aot.sharding.make_mesh(spec.mesh, devices))
  assert layout.accum == 2
  return aot.compile_lowered(lowered["train_step"])[1].as_text()


def _collectives(hlo):
  """[(kind, result shapes, runs a step)], runs counted as benchmarks.pods counts them."""
  from benchmarks.dots import hlo_runs
  comps, runs = hlo_runs(hlo)
  out = []
  for comp, lines in comps.items():
    for line in lines:
      m = re.search(r"= (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all)(?:-start)?\(", line)
      if m and runs[comp]:
        shapes = [tuple(int(d) for d in dims.split(",")) for dims in
                  re.findall(r"\w+\[([\d,]+)\]", m.group(1))]
        out.append((m.group(2), shapes, runs[comp]))
  return out


@pytest.mark.slow
def test_a_data_parallel_step_reduces_once_and_gathers_only_parameters():
  """Split over data alone, a train step reduces its gradients once, after the
  micro-batch loop (a scalar target count per micro-batch aside), and gathers nothing but
  the parameters (optim.shard_optimizer: the updated shares; Muon's updates as stacks of
  matrices): never the batch's hidden states (the cross-entropy's chunks run along
  positions; a scan along the split batch gathered the whole global batch onto every
  chip)."""
  from tests.helpers import model_spec
  m = model_spec(_dp_config())
  kv = m.n_kv_head * m.head_dim
  shapes = {(m.padded_vocab, m.n_embd), (m.n_embd, m.padded_vocab), (m.padded_vocab, kv)}
  shapes |= {(a, b) for a in (m.n_embd, 4 * m.n_embd, kv) for b in (m.n_embd, 4 * m.n_embd, kv)}
  for shard in (False, True):
    found = _collectives(_data_parallel_step(shard))
    big = [(kind, runs) for kind, sh, runs in found
           if kind in ("all-reduce", "reduce-scatter") and any(len(s) > 1 for s in sh)]
    assert big and all(runs == 1 for _, runs in big), (shard, big)
    gathered = [s for kind, sh, _ in found if kind == "all-gather" for s in sh]
    if not shard:
      assert not gathered
    else:
      assert gathered and all(s in shapes or (len(s) == 3 and s[0] % 4 == 0 and s[1:] in shapes)
                              for s in gathered), gathered


@pytest.mark.slow
def test_decode_programs_compile_with_the_bank_kernel():
  """Decoding on a v5e-4 (batch over data, tables whole): the bank-decode kernel is
  chosen because it compiles for the target (Mosaic: `bank_decode.resolve`, asked once
  by spec.resolve for the slice's chips), and the decode step and a prefill chunk
  compile with it, the cache donated."""
  spec = aot.spec_for(_config(data=4), "v5e-4")
  assert spec.model.decode_attention == "fused"
  devices, _ = topology.devices("v5e-4")
  dec = aot.Decoding(spec, aot.sharding.make_mesh(spec.mesh, devices))
  assert dec.model_spec.decode_attention == "fused" and dec.unit == 4
  fig, compiled = aot.compile_lowered(dec.decode_step(8))
  assert _custom_calls(compiled) >= 1
  assert fig["alias_bytes"] >= dec.cache_bytes_per_sequence() * 8 // 4 // 2  # cache donated
  fig, _ = aot.compile_lowered(dec.prefill(4, 128))
  assert fig["peak_bytes"] > 0


def _main(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return command("main", "--mode=compile", *args, env=env, timeout=timeout)


@pytest.mark.slow
def test_a_program_that_cannot_fit_exits_1_naming_it():
  """A device batch of 16,384 rows of 256 tokens on each v5e chip: the eval step's
  activations overflow 16 GB (libtpu 0.0.50.1 fits 8,192 in 10 GiB); the line names the program, its peak or overflow, HBM
  and what lowers it; the last line is the report."""
  out = _main("--config=configs/tiny.py", "--topology=v5litepod-4", "--programs=eval",
              "--config.train.device_batch_size=16384", "--config.train.batch_tokens=16777216")
  assert out.returncode == 1, out.stderr[-2000:]
  error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert error and "eval_step" in error[0] and "15.75 GiB HBM" in error[0], out.stderr[-2000:]
  assert "model.remat" in error[0] and "train.device_batch_size" in error[0]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report["fits"] is False and report["failed"] == ["eval_step"]
  assert report["chips"] == 4 and report["spec"]["attention"] == "splash"


@pytest.mark.slow
def test_bad_topology_and_programs_exit_2():
  out = _main("--config=configs/tiny.py", "--topology=v5p-63")
  assert out.returncode == 2 and "known:" in out.stderr and "v5p-64" in out.stderr
  out = _main("--config=configs/tiny.py", "--topology=v5p-8", "--programs=train,serve")
  assert out.returncode == 2 and "--programs" in out.stderr and "serve" in out.stderr
  out = _main("--config=configs/tiny.py")
  assert out.returncode == 2 and "--topology" in out.stderr
  out = _main("--config=configs/tiny.py", "--topology=2xv5e-4", "--config.mesh.data=1",
              "--config.mesh.fsdp=-1")  # FSDP across the two slices
  assert out.returncode == 2 and "mesh.slices=2 must divide mesh.data=1" in out.stderr
  out = _main("--config=configs/tiny.py", "--topology=2xv5e-4", "--config.mesh.slices=4")
  assert out.returncode == 2 and "is 2 slices, but mesh.slices=4" in out.stderr


def test_the_memory_line_says_what_its_peak_counts():
  m = {"argument_bytes": 2 * aot.GiB, "output_bytes": aot.GiB, "temp_bytes": 5 * aot.GiB,
       "code_bytes": 0, "alias_bytes": 0, "peak_bytes": 3 * aot.GiB, "peak_counts": "live"}
  line = aot.memory_line("train_step", m, 16 * aot.GiB)
  assert line.startswith("train_step: peak 3.00 GiB of 16.00 GiB HBM (19%) (the most live at "
                         "once) | allocated: arguments 2.00, outputs 1.00, temporaries 5.00")
  assert "(the parts summed" in aot.memory_line("eval_step", dict(m, peak_counts="sum"))


def test_the_serving_engines_decode_step_compiles_for_a_chip_at_its_budget():
  """benchmarks.serve_compile: the engine's decode step (its largest bucket) lowered for
  one compile-only v5e chip; the budget search keeps the most whole sequences' pages
  that fit the limit (one more sequence does not), and a bank layer's keys-only pages
  make BoV's page smaller than the baseline's."""
  from benchmarks import serve_compile

  devices, _ = topology.devices("v5e-4")
  bov = serve_compile.ChipEngine(_config(), devices[0], page_size=16)
  base_cfg = _config()
  base_cfg.model.value.preset = "gpt_base"
  base = serve_compile.ChipEngine(base_cfg, devices[0], page_size=16)
  assert bov.page_bytes < base.page_bytes
  one = bov.figures(bov.max_pages)
  assert one["slots"] == 1 and one["peak_bytes"] > bov.param_bytes
  limit = one["peak_bytes"] + 6 * bov.max_pages * bov.page_bytes
  best = serve_compile.budget(bov, limit, log=lambda _: None)
  assert best["peak_bytes"] <= limit and best["slots"] == best["pages"] // bov.max_pages > 1
  more = bov.figures(best["pages"] + bov.max_pages)
  assert more["peak_bytes"] > limit


def test_over_two_slices_only_the_gradient_reduction_crosses_them():
  """A small model on 2 x v5e-4, two micro-batches, bfloat16 compute as on TPU: the
  compiled step of a slice sends across slices only the gradient reduction, none of it
  from inside the micro-batch loop: Adam's shares all-reduced, Muon's reduce-scattered,
  its momentum's rows to the matrices' owners and their updates back (and Muon's
  per-row statistics), within 1.1x of each chip's gradient share all-reduced, as
  `plan.across_slices` says; its own collectives name only the slice's four chips."""
  from benchmarks import pods
  from bov_jax.run import plan

  cfg = _config()
  cfg.train.batch_tokens, cfg.train.device_batch_size = 256 * 16, 1
  cfg.model.dtype = "bfloat16"
  spec = aot.spec_for(cfg, "2xv5e-4")
  devices, _ = topology.devices("2xv5e-4")
  mesh = aot.sharding.make_mesh(spec.mesh, devices)
  assert dict(mesh.shape) == {"slice": 2, "data": 4, "fsdp": 1, "tensor": 1}
  assert [{d.slice_index for d in block.flat} for block in mesh.devices] == [{0}, {1}]
  layout, lowered = aot.train_programs(spec, mesh)
  assert layout.accum == 2
  _, compiled = aot.compile_lowered(lowered["train_step"])
  text = compiled.as_text()
  cross = pods.across_slices(text, slices=2)
  assert set(cross["bytes"]) <= {"all_reduce", "reduce_scatter", "all_to_all", "all_gather",
                                 "one_to_one"} and cross["in_loops"] == 0
  planned = plan.across_slices(spec)
  assert planned["floor_bytes_per_chip"] == plan.gradient_share_bytes(spec)  # a ring of two
  assert planned["sent_bytes_per_chip"] <= cross["sent"] <= 1.1 * planned["floor_bytes_per_chip"]
  assert cross["bytes"]["one_to_one"] < 0.01 * cross["sent"]  # Muon's per-row statistics
  groups = re.findall(r"replica_groups=\{\{([\d,]+)\}", text)
  assert groups and all(max(map(int, g.split(","))) < 4 for g in groups)
