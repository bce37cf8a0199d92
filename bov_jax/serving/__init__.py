"""Serving: a long-lived engine that holds the model once and decodes many requests at
a time by continuous batching over a paged cache whose bank layers keep keys only
(engine.py, pages.py, programs.py), and the OpenAI-compatible HTTP API in front of it
(server.py).

Imports: data, host, inference, kernels, model, parallel, run, store.
"""
