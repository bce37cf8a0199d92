"""Config schema, value-mode resolution and the named errors for bad settings."""
import pytest

from bov_jax.settings import config as config_lib
from bov_jax.settings import values
from tests.helpers import command
from tests.helpers import run_spec
from tests.helpers import small_config


def _mode(L=12, **kw):
  c = small_config(kw.pop("preset", ""), n_layer=L)
  for k, v in kw.items():
    c.model.value[k] = v
  return run_spec(c).model.value


def test_target_layer_rules():
  assert values.target_layers(_mode(preset="gpt_base_v_from_value_emb_learn"), 12) == [8, 9, 10, 11]
  assert values.target_layers(_mode(24, preset="gpt_base_v_from_value_emb_learn"), 24) == list(range(16, 24))
  m = _mode(preset="gpt_base_v_from_x0_learn_every2")
  assert values.target_layers(m, 12) == [1, 3, 5, 7, 9, 11]
  assert values.target_layers(_mode(11, preset="gpt_base_v_from_x0_learn_every2"), 11) == [0, 2, 4, 6, 8, 10]
  assert values.target_layers(_mode(preset="gpt_base_v_from_v1_every_layer"), 12) == list(range(1, 12))
  assert values.target_layers(_mode(11, preset="gpt_base_v_from_v1_learn_every2"), 11) == [2, 4, 6, 8, 10]
  assert values.target_layers(_mode(preset="gpt_base_v_from_value_emb_learn_second_half"), 12) == list(range(6, 12))
  assert values.target_layers(_mode(preset="gpt_base_v_from_value_emb_learn_last_two_thirds"), 12) == list(range(4, 12))
  assert values.target_layers(_mode(source="table", coeff="learned", layers="8, 9,11"), 12) == [8, 9, 11]
  assert values.target_layers(_mode(preset="gpt_base"), 12) == []


def test_preset_sets_four_settings_and_overrides_win():
  m = _mode(preset="gpt_base_v_from_value_emb_learn")
  assert (m.source, m.combine, m.coeff, m.layers, m.shared_table) == (
      "table", "replace", "learned", "last_third", False)
  assert m.preset == "gpt_base_v_from_value_emb_learn"
  m = _mode(preset="gpt_base_v_from_value_emb_learn", layers="every_other")
  assert m.layers == "every_other" and m.preset == ""  # no longer that named variant
  m = _mode(source="x0", coeff="learned")
  assert (m.combine, m.layers) == ("replace", "last_third")
  assert _mode().is_baseline


def test_every_preset_validates():
  for name in values.PRESETS:
    assert _mode(preset=name).preset == name


@pytest.mark.parametrize("settings, message", [
    (dict(preset="gpt_base_v_from_value_emb_lern"), r"model\.value\.preset=.*allowed:.*gpt_base_v_from_value_emb_learn"),
    (dict(source="tabel"), r"model\.value\.source='tabel'.*residual, x0, v1, table"),
    (dict(source="table", combine="mix"), r"model\.value\.combine='mix'.*replace, add, gated_add, scale"),
    (dict(source="table", coeff="maybe"), r"model\.value\.coeff='maybe'.*fixed, learned"),
    (dict(source="x0", combine="scale", coeff="learned"), r"combine='scale'.*source='residual'"),
    (dict(combine="scale", coeff="fixed"), r"combine='scale'.*coeff='learned'"),
    (dict(combine="add"), r"combine='add'.*model\.value\.source must be"),
    (dict(coeff="learned"), r"source='residual' with combine='replace'.*coeff='fixed'"),
    (dict(source="x0", shared_table=True), r"shared_table=True needs model\.value\.source='table'"),
    (dict(source="table", combine="gated_add", coeff="fixed"), r"gated_add.*coeff must be 'learned'"),
    (dict(source="table", layers="first_third"), r"model\.value\.layers='first_third'.*last_third"),
    (dict(source="table", layers="3,99"), r"model\.value\.layers='3,99'.*\[0, 11\]"),
    (dict(source="v1", layers="0"), r"selects no target layer.*layer 0 is never a target"),
])
def test_contradictions_are_named(settings, message):
  with pytest.raises(values.ValueModeError, match=message):
    _mode(**settings)


@pytest.mark.parametrize("field, value, message", [
    ("n_head", 5, r"model\.n_embd=64 must be divisible by model\.n_head=5"),
    ("n_kv_head", 3, r"model\.n_head=4 must be a multiple of model\.n_kv_head=3"),
    ("window_pattern", "SSXL", r"model\.window_pattern='SSXL'"),
    ("dtype", "float64", r"model\.dtype='float64'"),
    ("n_layer", 0, r"model\.n_layer=0"),
    ("remat", "some", r"model\.remat='some': expected one of none, dots, dots_no_batch, full"),
])
def test_bad_model_settings_are_named(field, value, message):
  c = small_config("gpt_base")
  c.model[field] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    run_spec(c)


def test_main_rejects_bad_config_before_building(tmp_path):
  out = command("main", "--config=configs/tiny.py",
                "--mode=plan", "--config.model.value.source=tabel", timeout=120)
  assert out.returncode == 2
  assert "model.value.source='tabel'" in out.stderr


def test_assign_sets_a_dotted_setting_whatever_its_type():
  c = config_lib.base_config()
  assert config_lib.assign(c, "optim.matrix_lr", 1) and c.optim.matrix_lr == 1
  assert config_lib.assign(c, "model.value.preset", "gpt_base")
  assert c.model.value.preset == "gpt_base"
  before = c.to_dict()
  assert not config_lib.assign(c, "optim.no_such", 3)  # a setting the schema lacks
  assert not config_lib.assign(c, "nowhere.at.all", 3) and c.to_dict() == before
