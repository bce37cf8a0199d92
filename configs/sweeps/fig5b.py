"""Figure 5b of the paper: Bank of Values component ablations at d12."""
from bov_jax.sweep import from_presets


ROWS = [
    ("bov", "gpt_base_v_from_value_emb_learn"),
    ("no_coeff", "gpt_base_v_from_value_emb"),
    ("shared_table", "gpt_base_v_from_value_emb_learn_shared"),
    ("every_layer", "gpt_base_v_from_value_emb_learn_every_layer"),
    ("add_v", "gpt_base_add_init_value_emb_learn"),
    ("gated_add_v", "gpt_base_add_init_value_emb_nanogpt"),
]


def get_sweep():
  return from_presets("configs/baseline_135m.py", ROWS)
