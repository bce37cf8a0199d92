"""Beyond Figure 5b, at d12: the gated additive variant (V + g E_v[i], the input-dependent
gate of the modded-nanogpt value embeddings) in the last third. Run it beside fig5b.py
with the same --workdir_root: its BoV point is the figure's."""
from bov_jax.jobs.sweep import from_presets

ROWS = [
    ("gated_add_v", "gpt_base_add_init_value_emb_nanogpt"),
]


def get_sweep():
  return from_presets("configs/baseline_135m.py", ROWS)
