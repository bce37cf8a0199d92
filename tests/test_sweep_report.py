"""Sweeps print one command per point; reports turn runs into plots and a table."""
import json
import os

import pytest

from bov_jax.jobs import report
from bov_jax.jobs import sweep
from tests.conftest import ROOT
from tests.helpers import command
from tests.helpers import random_model
from tests.helpers import small_config
from tests.helpers import xla_flags


def _sweep(*args):
  return command("sweep", *args, timeout=120)


@pytest.mark.parametrize("name, n", [("table1", 13), ("table2", 5), ("fig5b", 5),
                                     ("fig5b_extra", 1), ("table3_5", 2),
                                     ("layer_targeting", 5), ("table1_cpu", 13)])
def test_shipped_sweeps_print_one_command_per_point(name, n):
  out = _sweep(f"--sweep=configs/sweeps/{name}.py", "--print")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.strip().splitlines()
  assert len(lines) == n
  assert all(line.startswith("python -m bov_jax.main --config=configs/") for line in lines)
  assert len({line.split("--workdir=")[1].split()[0] for line in lines}) == n  # a workdir each
  assert not any("target_flops" in line or "num_iterations" in line for line in lines)


def test_table1_rows_are_the_paper_variants():
  lines = _sweep("--sweep=configs/sweeps/table1.py", "--print").stdout.splitlines()
  presets = [line.split("--config.model.value.preset=")[1].split()[0] for line in lines]
  assert presets[0] == "gpt_base" and presets[8] == "gpt_base_v_from_x0_learn"
  assert presets[-1] == "gpt_base_add_init_res_v_learn"


def test_every_point_keeps_the_flop_budget(tmp_path):
  f = tmp_path / "bad.py"
  f.write_text("def get_sweep():\n  return {'base': 'configs/tiny.py', 'points': [\n"
               "    {'name': 'a', 'overrides': {'train.num_iterations': 5}}]}\n")
  out = _sweep(f"--sweep={f}", "--print")
  assert out.returncode == 2 and "keeps the base's FLOP budget" in out.stderr


def test_figure_5b_and_tables_3_5_are_the_papers():
  presets = lambda name: [line.split("--config.model.value.preset=")[1].split()[0] for line in
                          _sweep(f"--sweep=configs/sweeps/{name}.py", "--print").stdout.splitlines()]
  assert presets("fig5b") == [
      "gpt_base_v_from_value_emb_learn", "gpt_base_v_from_value_emb_learn_shared",
      "gpt_base_v_from_value_emb", "gpt_base_v_from_value_emb_learn_every_layer",
      "gpt_base_add_init_value_emb_learn"]
  assert presets("table3_5") == ["gpt_base_v_from_value_emb_learn",
                                 "gpt_base_add_init_value_emb_nanogpt_every2"]
  t35 = _sweep("--sweep=configs/sweeps/table3_5.py", "--print").stdout
  assert "configs/baseline_780m.py" in t35


def test_overrides_pass_through_and_product():
  pts = sweep.product([("a", {"x": 1}), ("b", {"x": 2})], [("s", {"y": 0})])
  assert [p["name"] for p in pts] == ["a-s", "b-s"] and pts[1]["overrides"] == {"x": 2, "y": 0}
  out = _sweep("--sweep=configs/sweeps/table2.py", "--print", "--workdir_root=gs://b/r",
               "--config.train.seed=4")
  assert "--workdir=gs://b/r/bov " in out.stdout and "--config.train.seed=4" in out.stdout


def test_cache_memory_formula():
  # Eq. 6: (L/3) * d * (T - |V|) elements per sequence
  assert report.cache_saved_bytes(8, 1536, 32768, [65536], 1) == [8 * 1536 * (65536 - 32768)]
  assert report.cache_saved_bytes(4, 768, 32768, [2048], 2)[0] < 0  # short contexts: no win


def _run_dir(wd: str, preset: str, bpb: float) -> str:
  """A run directory as a short run of the tiny model leaves it: its config, its last
  checkpoint and metrics whose validation bpb falls with the tokens."""
  from flax import nnx

  from bov_jax.store import checkpoint
  cfg = small_config(preset, n_layer=2)  # the second layer is the bank layer
  checkpoint.save_params(wd, cfg, nnx.to_pure_dict(nnx.state(random_model(cfg))), step=6)
  with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    for step in (0, 3, 6):
      f.write(json.dumps({"step": step, "tokens": step * 1024, "train_loss": 6.0 - step / 10,
                          "val_bpb": bpb - step / 10}) + "\n")
  return wd


@pytest.mark.slow
def test_report_on_two_runs(tmp_path):
  """Two run directories (baseline and BoV) -> PNGs and a Markdown table."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  runs = [_run_dir(str(tmp_path / p), p, b)
          for p, b in (("gpt_base", 3.1), ("gpt_base_v_from_value_emb_learn", 3.0))]
  coeffs = report.coefficients(runs[1])
  assert sorted(coeffs["layers"]) == [1] and "gamma" in coeffs["layers"][1]  # of 2 layers
  out = command("report", *runs, f"--out={tmp_path}/rep", env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  written = json.loads(out.stdout.strip().splitlines()[-1])["written"]
  assert sum(w.endswith(".png") for w in written) >= 2
  md = open(os.path.join(tmp_path, "rep", "results.md")).read()
  row = next(line for line in md.splitlines() if "gpt_base_v_from_value_emb_learn" in line)
  assert row.split("|")[5].strip() == "1"  # the layers column: the bank layer
  # without matplotlib: one line naming the extra, exit 1, and the tables still written
  hide = tmp_path / "no_matplotlib"
  (hide / "matplotlib").mkdir(parents=True)
  (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
  out = command("report", *runs, f"--out={tmp_path}/rep2", timeout=300, env=dict(env, PYTHONPATH=f"{hide}{os.pathsep}{ROOT}"))
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
  (line,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert "pip install '.[report]'" in line
  assert os.path.exists(os.path.join(tmp_path, "rep2", "results.md"))
