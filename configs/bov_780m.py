"""Bank of Values at 780M (d24), Table 6: gamma * E_l[id] in the last third of the layers."""
from bov_jax.settings.config import depth_config


def get_config():
  c = depth_config(24, preset="gpt_base_v_from_value_emb_learn")
  c.train.batch_tokens = 1048576
  c.train.device_batch_size = 4
  c.train.target_flops = 3.91e19
  return c
