"""Run directories (the config of record, resume checks) and the one restore path."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax import checkpoint
from bov_jax import config as config_lib
from tests.helpers import small_config


def test_a_new_workdir_takes_the_config(tmp_path):
  wd = str(tmp_path / "run")
  cfg = small_config()
  checkpoint.adopt_config(wd, cfg)
  assert checkpoint.read_config(wd).to_dict() == cfg.to_dict()


def test_a_resume_refuses_what_cannot_restore_naming_both_values(tmp_path):
  wd = str(tmp_path / "run")
  checkpoint.adopt_config(wd, small_config(n_layer=5))
  checkpoint.adopt_config(wd, small_config())  # nothing to restore yet: any change is taken
  assert checkpoint.read_config(wd).model.n_layer == 6
  ckpts = checkpoint.Checkpoints(wd, async_save=False)
  ckpts.save(1, {"w": jnp.ones(2)})
  ckpts.close()
  bad = small_config(n_layer=4)
  bad.data.corpus = "/data/other"
  with pytest.raises(checkpoint.RunDirError) as e:
    checkpoint.adopt_config(wd, bad)
  msg = str(e.value)
  assert "model.n_layer: the run has 6, asked for 4" in msg
  assert "data.corpus: the run has 'embedded', asked for '/data/other'" in msg
  other_mode = small_config("gpt_base_v_from_x0_learn")
  with pytest.raises(checkpoint.RunDirError, match=r"model\.value: the run has "
                     r"'gpt_base_v_from_value_emb_learn', asked for 'gpt_base_v_from_x0_learn'"):
    checkpoint.adopt_config(wd, other_mode)
  assert checkpoint.read_config(wd).model.n_layer == 6  # nothing was written


def test_a_resume_takes_and_records_safe_changes(tmp_path):
  wd = str(tmp_path / "run")
  checkpoint.adopt_config(wd, small_config())
  same_mode = small_config("")  # the preset's four settings, given one by one
  same_mode.model.value.update(source="table", combine="replace", coeff="learned",
                               layers="last_third", shared_table=False)
  checkpoint.adopt_config(wd, same_mode)  # the same value mode: nothing to refuse
  longer = small_config()
  longer.train.num_iterations = 50
  longer.optim.matrix_lr = 0.01
  logged = []
  checkpoint.adopt_config(wd, longer, log=logged.append)
  assert "train.num_iterations 10 -> 50" in logged[0] and "optim.matrix_lr" in logged[0]
  (record,) = [json.loads(l) for l in (tmp_path / "run" / "config_changes.jsonl").read_text()
               .splitlines()]
  assert record["changes"]["train.num_iterations"] == [10, 50] and record["after_step"] is None
  assert checkpoint.read_config(wd).train.num_iterations == 50


def test_a_config_written_before_a_setting_existed_reads_with_its_default(tmp_path):
  cfg = small_config().to_dict()
  del cfg["log"]
  cfg["model"]["retired_setting"] = 1
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  read = checkpoint.read_config(str(tmp_path))
  assert read.log.tensorboard is True and "retired_setting" not in read.model
  assert read.model.n_layer == 6


def test_a_workdir_that_is_a_file_is_named(tmp_path):
  f = tmp_path / "metrics.jsonl"
  f.write_text("")
  with pytest.raises(checkpoint.RunDirError, match=r"--workdir=.*metrics\.jsonl is a file"):
    checkpoint.path(str(f))


def test_restore_parameters_alone_and_fall_back_past_a_corrupt_step(tmp_path):
  wd = str(tmp_path / "run")
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  ckpts = checkpoint.Checkpoints(wd, async_save=False)
  assert ckpts.restore(params) is None  # nothing saved yet
  for step in (1, 2):
    ckpts.save(step, jax.tree.map(lambda x: x * step, params), meta={"step": step})
  ckpts.close()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  step, got, opt, meta, _ = checkpoint.Checkpoints(wd).restore(abstract)
  assert step == 2 and opt is None and meta == {"step": 2}
  np.testing.assert_array_equal(np.asarray(got["w"]), 2 * np.arange(6.0).reshape(2, 3))
  for p in (tmp_path / "run" / "checkpoints" / "2" / "params").rglob("*"):
    if p.is_file():
      p.write_bytes(b"garbage")
  logged = []
  step, got, _, _, _ = checkpoint.Checkpoints(wd).restore(abstract, log=logged.append)
  assert step == 1 and "checkpoints/2 is unreadable" in logged[0]
  for p in (tmp_path / "run" / "checkpoints" / "1" / "params").rglob("*"):
    if p.is_file():
      p.write_bytes(b"garbage")
  with pytest.raises(checkpoint.CorruptCheckpointError, match=r"steps \[1, 2\]"):
    checkpoint.Checkpoints(wd).restore(abstract, log=lambda *_: None)


def test_fixed_settings_name_real_settings():
  flat = config_lib.flatten(config_lib.base_config())
  for key in config_lib.FIXED_ON_RESUME:
    assert key in flat or any(k.startswith(key + ".") for k in flat), key
