"""Models to and from other code: a run's weights as a Hugging Face style folder
(export.py) and the reference PyTorch checkpoints imported (nanochat.py).

Imports: data, host, model, run, settings, store.
"""
