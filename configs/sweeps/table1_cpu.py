"""Table 1 at a CPU-sized scale: the 13 variants on a 6-layer model, one FLOP budget.

The reproduction in docs/reproduction.md ran this sweep with --local on a 2-core CPU.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table1 import ROWS  # noqa: E402


def get_sweep():
  return {"base": "configs/tiny_budget.py",
          "points": [{"name": f"{i + 1:02d}_{name}",
                      "overrides": {"model.value.preset": preset}}
                     for i, (name, preset) in enumerate(ROWS)]}
