"""bov_jax: GPT-style language models whose deep layers look their values up by token id
(Bank of Values), trained, evaluated and served with JAX.

The commands are the modules here, each flags, one call into the library and its exit
code (cli.py is what they share):

  main       python -m bov_jax.main --config=FILE   train, plan, compile, eval, sample
  export     a run's weights as a Hugging Face style folder
  lm_eval    EleutherAI's lm-evaluation-harness on a run or a folder
  sweep      an experiment grid, one main command per point
  report     the paper's tables and figures from finished runs
  convert    a reference (nanochat) checkpoint as a run directory
  tokenizer  the authors' tokenizer trained, or text encoded
  corpus     ClimbMix downloaded

The library is in folders, each importing only the folders below it (its `__init__.py`
says which): a run flows config -> spec -> model / optimizer / data -> step -> loop ->
metrics and checkpoints.

  jobs        what a command runs: main's modes, sweeps, reports
  training    the steps, the loop, the programs compiled for a TPU slice
  interop     exported folders, the reference's checkpoints
  evaluation  bits per byte, CORE, lm-eval
  inference   generation and sampling
  run         the run spec (the config checked and resolved once) and its costs
  model       the GPT with every value mode, its init, cache and parameters
  data        corpora, the tokenizer, batches
  optim       Muon and AdamW, the LR schedule
  kernels     attention and the bank layers' decode kernel, per backend
  parallel    the mesh, the sharding rules, the optimizer state's layout
  store       storage, the run directory, checkpoints, weights files, metrics
  settings    the config schema, the value modes, the model spec
  runtime     the process: who prints, caches, huge pages, optional extras
"""
