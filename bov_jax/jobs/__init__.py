"""What a command runs, from its settings to its result: `python -m bov_jax.main`'s
modes (modes.py), experiment grids (sweep.py), the paper's tables and figures from
finished runs (report.py).

Imports: data, evaluation, host, inference, model, parallel, run, settings, store, training.
"""
