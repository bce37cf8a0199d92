"""The paper's optimizer (optimizer.py): Muon for block matrices, AdamW groups for the
rest, the LR schedule, and the effective learning rates from the base ones.

Imports: kernels, parallel.
"""
