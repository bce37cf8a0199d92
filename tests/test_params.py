"""model/params.py: the model's parameters placed on a mesh, and weights read into them."""
import jax
import ml_dtypes
import numpy as np
import pytest

from bov_jax.model import params as params_lib
from bov_jax.store import safetensors
from tests.helpers import equal_bits
from tests.helpers import weights_dict


def test_weights_are_placed_as_the_parameters_are_and_checked(tmp_path):
  """model.init_from and an exported folder's --workdir: the folder's weights, bit for bit,
  placed as the run's parameters; a folder of another shape is refused naming the tensors
  that differ."""
  params = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), weights_dict())
  safetensors.write_weights(str(tmp_path / "f"), weights_dict())
  placed = params_lib.placed(safetensors.read_weights(str(tmp_path / "f")), params,
                             "model.init_from=f")
  equal_bits(placed, weights_dict())
  other = dict(weights_dict(), wte=np.zeros((11, 4), ml_dtypes.bfloat16))
  safetensors.write_weights(str(tmp_path / "g"), other)
  with pytest.raises(safetensors.WeightsError, match=r"model\.init_from=g.*\['wte'\]"):
    params_lib.placed(safetensors.read_weights(str(tmp_path / "g")), params, "model.init_from=g")
