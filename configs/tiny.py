"""A CPU-sized Bank of Values model, the default of the README's main job.

Six layers, so the last third holds two bank layers (4 and 5); a 128-token
short window inside a 256-token context, so sliding windows are exercised.
Trains on the embedded corpus (Python's own library source and docs).
"""
from bov_jax.settings.config import base_config


def get_config():
  c = base_config()
  c.model.n_layer = 6
  c.model.n_embd = 128
  c.model.n_head = 2
  c.model.n_kv_head = 2
  c.model.sequence_len = 256
  c.model.vocab_size = 4096
  c.model.window_pattern = "SSSL"
  c.model.short_window = 128
  c.model.value.preset = "gpt_base_v_from_value_emb_learn"
  c.train.batch_tokens = 4096
  c.train.device_batch_size = 16
  c.train.num_iterations = 300
  # 4096-token steps are 1/128 of the paper's batch, and the code scales every LR by
  # sqrt(batch / 2^19) (optim.hyperparams); base LRs 4x the paper's keep the tiny model
  # learning within a few minutes on a laptop CPU.
  c.optim.matrix_lr = 0.08
  c.optim.embedding_lr = 1.2
  c.optim.unembedding_lr = 0.032
  c.optim.scalar_lr = 2.0
  c.train.eval_every = 50
  c.train.eval_tokens = 65536
  c.train.checkpoint_every = 100
  c.train.log_every = 10
  return c
