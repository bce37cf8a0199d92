"""Bank of Values with different target layers at d12: a product over one axis."""
from bov_jax.jobs.sweep import product

LAYERS = ["last_third", "every_other", "second_half", "last_two_thirds", "all"]


def get_sweep():
  return {"base": "configs/bov_135m.py",
          "points": product([(rule, {"model.value.layers": rule}) for rule in LAYERS])}
