"""Table 2 of the paper: baseline, BoV, x0 W_v, V1 and V1 at every layer at d24 (780M)."""
from bov_jax.jobs.sweep import from_presets

ROWS = [
    ("baseline", "gpt_base"),
    ("bov", "gpt_base_v_from_value_emb_learn"),
    ("x0_learn", "gpt_base_v_from_x0_learn"),
    ("v1_learn", "gpt_base_v_from_v1_learn"),
    ("v1_every_layer", "gpt_base_v_from_v1_every_layer"),
]


def get_sweep():
  return from_presets("configs/baseline_780m.py", ROWS)
