"""The paper's 135M (d12) baseline, Table 6: 2^19 tokens a step, 1.50e18 FLOPs."""
from bov_jax.config import depth_config


def get_config():
  c = depth_config(12, preset="gpt_base")
  c.train.batch_tokens = 524288
  c.train.device_batch_size = 16
  c.train.target_flops = 1.5e18
  return c
