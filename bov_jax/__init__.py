"""bov_jax: GPT-style language models whose deep layers look their values up by token id
(Bank of Values), trained, evaluated and served with JAX.

The commands are the modules at this level (`python -m bov_jax.main`, `export`, `lm_eval`,
`sweep`, `report`, `convert`, `tokenizer`, `corpus`; `cli.py` is what they share): flags,
one call into the library, the exit code. The library is in folders, each importing only
the folders below it; each folder's `__init__.py` says what it holds, and
docs/design.md maps them.
"""
