"""Bank of Values with different target layers at d12: a product over one axis."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bov_jax.sweep import product  # noqa: E402

LAYERS = ["last_third", "every_other", "second_half", "last_two_thirds", "all"]


def get_sweep():
  return {"base": "configs/bov_135m.py",
          "points": product([(rule, {"model.value.layers": rule}) for rule in LAYERS])}
