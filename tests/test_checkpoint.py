"""Orbax checkpoints: the one restore path, falling back past corrupt steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax.settings import config as config_lib
from bov_jax.store import checkpoint


def test_restore_parameters_alone_and_fall_back_past_a_corrupt_step(tmp_path):
  wd = str(tmp_path / "run")
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  ckpts = checkpoint.Checkpoints(wd, async_save=False)
  assert ckpts.restore(params) is None  # nothing saved yet
  for step in (1, 2):
    ckpts.save(step, jax.tree.map(lambda x: x * step, params), meta={"step": step})
  ckpts.close()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  step, got, opt, meta, _ = checkpoint.Checkpoints(wd).restore(abstract)
  assert step == 2 and opt is None and meta == {"step": 2}
  np.testing.assert_array_equal(np.asarray(got["w"]), 2 * np.arange(6.0).reshape(2, 3))
  for p in (tmp_path / "run" / "checkpoints" / "2" / "params").rglob("*"):
    if p.is_file():
      p.write_bytes(b"garbage")
  logged = []
  step, got, _, _, _ = checkpoint.Checkpoints(wd).restore(abstract, log=logged.append)
  assert step == 1 and "checkpoints/2 is unreadable" in logged[0]
  for p in (tmp_path / "run" / "checkpoints" / "1" / "params").rglob("*"):
    if p.is_file():
      p.write_bytes(b"garbage")
  with pytest.raises(checkpoint.CorruptCheckpointError, match=r"steps \[1, 2\]"):
    checkpoint.Checkpoints(wd).restore(abstract, log=lambda *_: None)


def test_fixed_settings_name_real_settings():
  flat = config_lib.flatten(config_lib.base_config())
  for key in config_lib.FIXED_ON_RESUME:
    assert key in flat or any(k.startswith(key + ".") for k in flat), key
