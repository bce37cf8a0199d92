"""How a model is scored: validation bits per byte (bpb.py), CORE (core.py, with the
authors' core_tasks.yaml), and EleutherAI's lm-evaluation-harness (harness.py).

Imports: data, host, inference, kernels, model, parallel, run, store.
"""
