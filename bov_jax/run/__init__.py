"""A run before anything runs: the run spec, the config checked once (`spec.check`)
and resolved with every derived setting (spec.py), and what it costs: parameters,
FLOPs, the step budget, the batch layout, memory (plan.py).

Imports: kernels, model, optim, parallel, settings.
"""
