"""Training: the state and the pure steps (step.py), the loop (train.py) and
agreed preemption (preemption.py), and the run's
programs compiled for a TPU slice (aot.py, as MaxText's train_compile.py beside its
train.py).

Imports: data, evaluation, host, inference, model, optim, parallel, run, store.
"""
