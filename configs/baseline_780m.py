"""The paper's 780M (d24) baseline, Table 6: 2^20 tokens a step, 3.91e19 FLOPs."""
from bov_jax.settings.config import depth_config


def get_config():
  c = depth_config(24, preset="gpt_base")
  c.train.batch_tokens = 1048576
  c.train.device_batch_size = 4
  c.train.target_flops = 3.91e19
  return c
