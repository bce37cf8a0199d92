"""The run directory: its config of record, resume checks, and every name in it."""
import json
import os
import subprocess

import jax.numpy as jnp
import pytest

from bov_jax.store import checkpoint
from bov_jax.store import rundir
from tests.conftest import ROOT
from tests.helpers import command
from tests.helpers import small_config


def _adopt(wd, cfg, log=print):
  """What the train loop does with a run directory's config: check, then record."""
  rundir.record_config(wd, cfg, rundir.check_config(wd, cfg), log)


def test_a_new_workdir_takes_the_config(tmp_path):
  wd = str(tmp_path / "run")
  cfg = small_config()
  _adopt(wd, cfg)
  assert rundir.read_config(wd).to_dict() == cfg.to_dict()


def test_a_resume_refuses_what_cannot_restore_naming_both_values(tmp_path):
  wd = str(tmp_path / "run")
  _adopt(wd, small_config(n_layer=5))
  _adopt(wd, small_config())  # nothing to restore yet: any change is taken
  assert rundir.read_config(wd).model.n_layer == 6
  ckpts = checkpoint.Checkpoints(wd, async_save=False)
  ckpts.save(1, {"w": jnp.ones(2)})
  ckpts.close()
  bad = small_config(n_layer=4)
  bad.data.corpus = "/data/other"
  with pytest.raises(rundir.RunDirError) as e:
    _adopt(wd, bad)
  msg = str(e.value)
  assert "model.n_layer: the run has 6, asked for 4" in msg
  assert "data.corpus: the run has 'embedded', asked for '/data/other'" in msg
  other_mode = small_config("gpt_base_v_from_x0_learn")
  with pytest.raises(rundir.RunDirError, match=r"model\.value: the run has "
                     r"'gpt_base_v_from_value_emb_learn', asked for 'gpt_base_v_from_x0_learn'"):
    _adopt(wd, other_mode)
  assert rundir.read_config(wd).model.n_layer == 6  # nothing was written


def test_a_resume_takes_and_records_safe_changes(tmp_path):
  wd = str(tmp_path / "run")
  _adopt(wd, small_config())
  same_mode = small_config("")  # the preset's four settings, given one by one
  same_mode.model.value.update(source="table", combine="replace", coeff="learned",
                               layers="last_third", shared_table=False)
  _adopt(wd, same_mode)  # the same value mode: nothing to refuse
  longer = small_config()
  longer.train.num_iterations = 50
  longer.optim.matrix_lr = 0.01
  logged = []
  _adopt(wd, longer, log=logged.append)
  assert "train.num_iterations 10 -> 50" in logged[0] and "optim.matrix_lr" in logged[0]
  (record,) = [json.loads(line) for line in (tmp_path / "run" / "config_changes.jsonl").read_text()
               .splitlines()]
  assert record["changes"]["train.num_iterations"] == [10, 50] and record["after_step"] is None
  assert rundir.read_config(wd).train.num_iterations == 50


def test_a_config_written_before_a_setting_existed_reads_with_its_default(tmp_path):
  cfg = small_config().to_dict()
  del cfg["log"]
  cfg["model"]["retired_setting"] = 1
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  read = rundir.read_config(str(tmp_path))
  assert read.log.tensorboard is True and "retired_setting" not in read.model
  assert read.model.n_layer == 6


def test_a_workdir_that_is_a_file_is_named(tmp_path):
  f = tmp_path / "metrics.jsonl"
  f.write_text("")
  with pytest.raises(rundir.RunDirError, match=r"--workdir=.*metrics\.jsonl is a file"):
    rundir.path(str(f))


def test_done_marks_a_finished_run_and_a_longer_run_clears_it(tmp_path):
  wd = str(tmp_path / "run")
  assert not rundir.is_done(wd)
  rundir.write_config(wd, small_config())
  rundir.mark_done(wd, {"step": 10})
  assert rundir.is_done(wd) and json.loads((tmp_path / "run" / rundir.DONE).read_text()) == {
      "step": 10}
  rundir.clear_done(wd)
  assert not rundir.is_done(wd)


def test_no_other_module_spells_a_run_directory_name():
  out = subprocess.run(["grep", "-rn", '"DONE"\\|"metrics.jsonl"\\|"checkpoints"\\|"config.json"',
                        "bov_jax"], capture_output=True, text=True, cwd=ROOT)
  files = {line.split(":", 1)[0] for line in out.stdout.splitlines()}
  assert files == {"bov_jax/store/rundir.py"}, out.stdout


@pytest.mark.slow
def test_a_batch_that_does_not_divide_leaves_nothing_behind(tmp_path):
  """The whole config, batch layout included, is checked before the run directory is
  touched: no config.json, tokenizer or checkpoints/ are left by a refused run."""
  wd = tmp_path / "run"
  out = command("main", "--config=configs/tiny.py",
                f"--workdir={wd}", "--config.train.batch_tokens=1000")
  assert out.returncode == 2 and "train.batch_tokens=1000" in out.stderr, out.stderr
  assert not wd.exists()
  plan = command("main", "--config=configs/tiny.py",
                 "--mode=plan", "--config.train.batch_tokens=1000")
  assert plan.returncode == 2 and "train.batch_tokens=1000" in plan.stderr, plan.stderr


def test_launch_script_names_done_as_rundir_does():
  import re
  script = open(os.path.join(ROOT, "launch", "tpu.sh")).read()
  assert re.search(r"^DONE_FILE=(\S+)", script, re.M).group(1) == rundir.DONE


def test_a_command_that_needs_a_run_names_what_is_missing(tmp_path):
  """config_of (export, report, lm_eval): a directory with neither a run's config.json
  nor an exported folder's run_config.json is refused by name."""
  with pytest.raises(rundir.RunDirError, match=r"--workdir=.* holds no config\.json or "
                                               r"run_config\.json"):
    rundir.config_of(str(tmp_path))
  cfg = small_config()
  rundir.write_config(str(tmp_path), cfg)
  assert rundir.config_of(str(tmp_path)).model.n_layer == cfg.model.n_layer


def test_a_torn_log_tail_is_read_past_and_cut_on_resume(tmp_path):
  """metrics.jsonl and config_changes.jsonl recover as write-ahead logs do: a torn last
  line is left out by readers and cut by a resume, saying how many bytes; a bad line with
  records after it is damage, named by file and line."""
  wd = tmp_path / "run"
  wd.mkdir()
  whole = '{"step": 1, "train_loss": 5.0}\n{"step": 2, "train_loss": 4.5}\n'
  (wd / rundir.METRICS).write_text(whole + '{"step": 3, "train_lo')
  (wd / rundir.CONFIG_CHANGES).write_text('{"after_step": 10}')  # whole, its newline lost
  assert [r["step"] for r in rundir.read_metrics(str(wd))] == [1, 2]
  assert (wd / rundir.METRICS).read_text().endswith("train_lo")  # a reader changes nothing
  said = []
  rundir.cut_torn_tails(str(wd), log=said.append)
  assert (wd / rundir.METRICS).read_text() == whole
  assert (wd / rundir.CONFIG_CHANGES).read_text() == '{"after_step": 10}\n'
  assert "cut 21 bytes" in said[0] and rundir.METRICS in said[0] and len(said) == 2
  rundir.cut_torn_tails(str(wd), log=said.append)
  assert len(said) == 2  # nothing more to cut
  (wd / rundir.METRICS).write_text('{"step": 1}\n{"step": 2, \n{"step": 3}\n')
  with pytest.raises(rundir.RunDirError, match=r"metrics.jsonl: line 2 is not a JSON record"):
    rundir.read_metrics(str(wd))
