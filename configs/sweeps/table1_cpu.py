"""Table 1 at a CPU-sized scale: the 13 variants on a 6-layer model, one FLOP budget.

The reproduction in docs/reproduction.md ran this sweep with --local on a 2-core CPU.
"""
import os

from bov_jax.jobs import sweep


def get_sweep():
  table1 = sweep.load(os.path.join(os.path.dirname(__file__), "table1.py"))
  return dict(table1, base="configs/tiny_budget.py")
