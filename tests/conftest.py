"""Test setup: 8 simulated CPU devices (set before jax is imported) and fp32 math."""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import pytest  # noqa: E402


@pytest.fixture
def small_cfg():
  """A tiny model where every mechanism is live: GQA, sliding windows, 6 layers."""
  from tests.helpers import small_config
  return small_config()
