"""Backend-specific kernels behind one switch each: what the model asks for stays the
same math on every backend; how it runs (Pallas on TPU and GPU, XLA elsewhere) is
decided here, behind the one switch the run spec resolves for each. Causal
sliding-window attention (attention.py), the bank layers' fused decode step
(bank_decode*.py), and the forms that XLA's CPU backend runs faster: the weight matmul's
backward (matmul.py, model.matmul), token choice (sampling.py, model.sampler) and Muon's
Gram-space Polar Express (polar.py, optim.polar_gram). Their gains are measured in
docs/performance.md.

Imports: parallel.
"""

import jax
import numpy as np


def div(a, d: int):
  """a // d for a >= 0, as the Pallas kernels index blocks. Truncating division: `//` on
  signed integers lowers through `sign`, which Mosaic lowers per TPU generation, so a
  lowering check off TPU could not run it."""
  return jax.lax.div(a, np.int32(d))
