"""The tiny model under a fixed FLOP budget (for CPU sweeps): each value mode trains for as
many steps as its own FLOPs per token allow, as in the paper's FLOP-matched tables."""
import os

from bov_jax.settings import config as config_lib


def get_config():
  c = config_lib.from_file(os.path.join(os.path.dirname(__file__), "tiny.py"))
  c.model.value.preset = "gpt_base"
  c.train.num_iterations = 0
  c.train.target_flops = 5.8e12   # about 120 steps of 4,096 tokens at ~11.8M FLOPs/token
  c.train.eval_every = 40
  c.train.sample_tokens = 0
  return c
