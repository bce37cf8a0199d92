"""Table 1 at a CPU-sized scale: the 13 variants on a 6-layer model, one FLOP budget.

The reproduction in docs/reproduction.md ran this sweep with --local on a 2-core CPU.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table1 import ROWS, from_presets  # noqa: E402


def get_sweep():
  return from_presets("configs/tiny_budget.py", ROWS, numbered=True)
