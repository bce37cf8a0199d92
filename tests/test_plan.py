"""`--mode=plan`: parameters, FLOPs and budgets of SPEC section 3, exactly."""
import json

import pytest

from bov_jax.run import plan
from bov_jax.settings import config as config_lib
from tests.helpers import command
from tests.helpers import model_spec
from tests.helpers import small_config


def _plan_cli(config, *overrides):
  out = command("main", f"--config={config}",
                "--mode=plan", *overrides, timeout=300)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("config, params, fpt, iters, tokens_per_step", [
    ("configs/baseline_135m.py", 135.3e6, 7.5969e8, 3766, 524288),
    ("configs/bov_135m.py", None, 7.4554e8, 3838, 524288),
    ("configs/baseline_780m.py", 780.1e6, 4.7752e9, 7809, 1048576),
    ("configs/bov_780m.py", None, 4.6620e9, 7998, 1048576),
])
def test_paper_budgets(config, params, fpt, iters, tokens_per_step):
  p = _plan_cli(config)
  assert round(p["flops_per_token"] / fpt, 4) == 1.0
  assert f"{p['flops_per_token']:.4e}" == f"{fpt:.4e}"
  assert p["num_iterations"] == iters
  assert p["tokens_per_step"] == tokens_per_step
  assert p["total_tokens"] == iters * tokens_per_step
  if params:
    assert f"{p['params'] / 1e6:.1f}" == f"{params / 1e6:.1f}"
    assert p["params_dense"] == p["params"]
  for key in ("preset", "params", "params_dense", "target_layers"):
    assert key in p


def test_bov_plan_fields():
  p = _plan_cli("configs/bov_780m.py")
  assert p["target_layers"] == list(range(16, 24))
  assert p["params"] - p["params_dense"] == 8 * 32768 * 1536  # eight tables
  assert p["params_dense"] == 780140569 - 8 * 1536 * 1536 + 8  # minus W_v, plus gammas
  assert f"{p['total_tokens'] / 1e9:.2f}" == "8.39"


def test_num_iterations_override_and_cli_overrides():
  p = _plan_cli("configs/tiny.py", "--config.train.num_iterations=7", "--config.model.n_layer=9")
  assert p["num_iterations"] == 7 and p["target_layers"] == [6, 7, 8]


def test_value_matmuls_counted_per_use():
  """x0 + add applies W_v twice (x W_v and x0 W_v), so it counts twice; V1 replace drops W_v."""
  count = lambda preset: plan.param_counts(model_spec(small_config(preset)))["n_matmul"]
  base = count("gpt_base")
  wv = 64 * 32
  assert count("gpt_base_add_init_res_v") == base + 2 * wv
  assert count("gpt_base_v_from_x0") == base
  assert count("gpt_base_v_from_v1") == base - 2 * wv
  assert count("gpt_base_add_init_value_emb_nanogpt") == base + 2 * 12 * 2


def test_attention_flops_use_windows():
  c = small_config("gpt_base", sequence_len=64, short_window=8)
  assert plan.attention_flops(model_spec(c)) == 12 * 64 * (4 * 8 + 2 * 64)  # SSSL SL: layer 3
  assert model_spec(c).windows[-1] == 64                                      # and the last: long


def test_scaling_params_is_dense_layout():
  assert plan.scaling_params(model_spec(config_lib.depth_config(12))) == 110100480
  assert plan.scaling_params(model_spec(config_lib.depth_config(
      12, "gpt_base_v_from_value_emb_learn"))) == 110100480


@pytest.mark.slow
def test_a_paper_config_without_its_corpus_is_named(tmp_path):
  """The paper configs read ClimbMix; where it is missing, the run stops before building
  anything, naming data.corpus and the command that fetches it. --mode=plan needs no data."""
  out = command("main", "--config=configs/bov_780m.py",
                f"--workdir={tmp_path}/run",
                f"--config.data.corpus={tmp_path}/climbmix", timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert f"data.corpus='{tmp_path}/climbmix'" in out.stderr
  assert "python -m bov_jax.corpus download" in out.stderr
  p = _plan_cli("configs/bov_780m.py")
  assert p["eval_tokens"] == 80 * 524288


def test_plan_over_two_slices_gives_what_crosses_them_against_the_compute():
  """--mode=plan --topology=2xv5p-64: the mesh's slices, each chip's gradient share (the
  optimizer's split of the parameters over a slice's 32 data chips), the floor (that
  share all-reduced across the slices) and what the step sends: Muon's part
  reduce-scattered, its momentum's rows to their owners (float32) and the updates back
  in bfloat16 (under bfloat16 compute), which on two slices sums to the floor; its time
  at --dcn_gbps beside the step's compute at the v5p's peak; a single slice has no such
  figures, and the same run named by mesh.slices is the same."""
  two = _plan_cli("configs/bov_780m.py", "--topology=2xv5p-64", "--dcn_gbps=50")
  assert two["mesh"] == {"slice": 2, "data": 32, "fsdp": 1, "tensor": 1}
  x = two["across_slices"]
  share = x["gradient_share_bytes"]
  assert two["param_bytes_per_device"] / 32 <= share <= two["param_bytes_per_device"] / 31
  assert x["floor_bytes_per_chip"] == share  # a ring of two: half out, half back in
  assert x["sent_bytes_per_chip"] == share and x["sent_vs_floor"] == 1.0
  f32 = _plan_cli("configs/bov_780m.py", "--topology=2xv5p-64", "--dcn_gbps=50",
                  "--config.optim.muon_update_dtype=float32")["across_slices"]
  assert f32["floor_bytes_per_chip"] == share < f32["sent_bytes_per_chip"] < 1.25 * share
  assert x["dcn_seconds"] == pytest.approx(share * 8 / 50e9)
  flops = two["flops_per_token"] * two["tokens_per_step"] / 64
  assert x["compute_seconds_at_peak"] == pytest.approx(flops / 459e12)
  same = _plan_cli("configs/bov_780m.py", "--topology=v5p-64", "--config.mesh.slices=2",
                   "--dcn_gbps=50")
  assert same["across_slices"] == x
  assert "across_slices" not in _plan_cli("configs/bov_780m.py", "--topology=v5p-64")


def test_plan_names_slices_that_cannot_split_the_run():
  bad = command("main", "--config=configs/bov_780m.py", "--mode=plan", "--topology=2xv5p-64",
                "--config.mesh.slices=4", timeout=300)
  assert bad.returncode == 2 and "--topology=2xv5p-64 is 2 slices, but mesh.slices=4" in bad.stderr
  fsdp = command("main", "--config=configs/bov_780m.py", "--mode=plan", "--topology=2xv5p-64",
                 "--config.mesh.data=1", "--config.mesh.fsdp=-1", timeout=300)
  assert fsdp.returncode == 2
  assert "mesh.slices=2 must divide mesh.data=1" in fsdp.stderr and "fsdp=64" in fsdp.stderr
