"""Tables 3 and 5 of the paper at d24 (780M): BoV (E_v[i], the last third) against the
additive variant as its authors run it (V + E_v[i] with an input-dependent, bounded gate,
every other layer). The `bov` point is table2.py's: with the same --workdir_root it is
trained once."""
from bov_jax.jobs.sweep import from_presets

ROWS = [
    ("bov", "gpt_base_v_from_value_emb_learn"),
    ("gated_add_every2", "gpt_base_add_init_value_emb_nanogpt_every2"),
]


def get_sweep():
  return from_presets("configs/baseline_780m.py", ROWS)
