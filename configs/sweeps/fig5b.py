"""Figure 5b of the paper: Bank of Values' components ablated at d12 (Section 5.3): a
shared table, the coefficient fixed at 1, a table at every layer, the standard value kept
(V + E_v[i]), against BoV itself. Points beyond the figure: fig5b_extra.py."""
from bov_jax.jobs.sweep import from_presets

ROWS = [
    ("bov", "gpt_base_v_from_value_emb_learn"),
    ("shared_table", "gpt_base_v_from_value_emb_learn_shared"),
    ("no_coeff", "gpt_base_v_from_value_emb"),
    ("every_layer", "gpt_base_v_from_value_emb_learn_every_layer"),
    ("add_v", "gpt_base_add_init_value_emb_learn"),
]


def get_sweep():
  return from_presets("configs/baseline_135m.py", ROWS)
