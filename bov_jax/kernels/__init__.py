"""Backend-specific kernels behind one switch each: what the model asks for stays the
same math on every backend; how it runs (Pallas on TPU and GPU, XLA elsewhere) is
decided here. Causal sliding-window attention (attention.py) and the bank layers'
fused decode step (bank_decode*.py).

Imports: parallel.
"""

import jax
import numpy as np


def div(a, d: int):
  """a // d for a >= 0, as the Pallas kernels index blocks. Truncating division: `//` on
  signed integers lowers through `sign`, which Mosaic lowers per TPU generation, so a
  lowering check off TPU could not run it."""
  return jax.lax.div(a, np.int32(d))
