"""Table 1 of the paper: the 13 value-vector variants at d12 (135M), 1.50e18 FLOPs each."""
from bov_jax.jobs.sweep import from_presets

ROWS = [
    ("baseline", "gpt_base"),
    ("v_scale_learn", "gpt_base_v_scale_learn"),
    ("v1_every_layer", "gpt_base_v_from_v1_every_layer"),
    ("v1_learn_every2", "gpt_base_v_from_v1_learn_every2"),
    ("v1", "gpt_base_v_from_v1"),
    ("v1_learn", "gpt_base_v_from_v1_learn"),
    ("x0_learn_every2", "gpt_base_v_from_x0_learn_every2"),
    ("x0", "gpt_base_v_from_x0"),
    ("x0_learn", "gpt_base_v_from_x0_learn"),
    ("add_v1", "gpt_base_add_init_v"),
    ("add_v1_learn", "gpt_base_add_init_v_learn"),
    ("add_x0", "gpt_base_add_init_res_v"),
    ("add_x0_learn", "gpt_base_add_init_res_v_learn"),
]


def get_sweep():
  return from_presets("configs/baseline_135m.py", ROWS, numbered=True)
