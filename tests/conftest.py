"""Test setup: 8 simulated CPU devices (set before jax is imported) and fp32 math."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The runs the tests start (python -m bov_jax.main, sweep, convert) share one fresh
# compilation cache for this session: a resume or a second run of the same config loads
# the step instead of compiling it again, as it does for users (train.compile_cache_dir),
# and nothing outside the session is read or written.
_CACHE = tempfile.mkdtemp(prefix="bov_jax_test_xla_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE

import jax  # noqa: E402  (after XLA_FLAGS)

# This process compiles everything afresh: tests here read compiled HLO and costs.
jax.config.update("jax_compilation_cache_dir", None)

import pytest  # noqa: E402


@pytest.fixture
def small_cfg():
  """A tiny model where every mechanism is live: GQA, sliding windows, 6 layers."""
  from tests.helpers import small_config
  return small_config()
