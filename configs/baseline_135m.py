"""The paper's 135M (d12) baseline, Table 6: 2^19 tokens a step, 1.50e18 FLOPs."""
from bov_jax.settings.config import depth_config


def get_config():
  c = depth_config(12, preset="gpt_base")
  c.train.batch_tokens = 524288
  # 8 rows of 2,048 tokens a chip per micro-batch: 16 overflow a v5e chip's 16 GB with
  # no remat (python -m bov_jax.main --mode=compile --topology=v5e-16; docs/pods.md)
  c.train.device_batch_size = 8
  c.train.target_flops = 1.5e18
  return c
