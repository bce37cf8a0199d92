"""A CPU-sized Bank of Values model, the default of the README's main job.

Six layers, so the last third holds two bank layers (4 and 5); a 128-token
short window inside a 256-token context, so sliding windows are exercised.
Trains on the embedded corpus (Python's own library source and docs).
"""
from bov_jax.config import base_config


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
  c.train.batch_tokens = 8192
  c.train.device_batch_size = 16
  c.train.num_iterations = 300
  c.train.eval_every = 50
  c.train.eval_tokens = 65536
  c.train.checkpoint_every = 100
  c.train.log_every = 10
  return c
