"""Validation bits per byte: the held-out split's nats per UTF-8 byte of its targets,
always over the same packed rows (the reference's evaluate_bpb).

  bpb = sum(nats over targets with token_bytes > 0) / (ln 2 * sum(token_bytes[targets]))

Special tokens have 0 bytes and count in neither sum.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from bov_jax.data import batches as data_lib
from bov_jax.data import corpus
from bov_jax.parallel import sharding


def bits_per_byte(nats: float, n_bytes: float) -> float:
  return float(nats) / (math.log(2.0) * float(n_bytes))


class Evaluator:
  """Validation bpb of parameters, over train.eval_tokens held-out tokens (each process
  packs its share of the validation split), in batches of `rows` rows per process."""

  def __init__(self, spec, mesh, eval_step, val_split, tok, rows: int):
    T = spec.model.sequence_len
    n_rows = max(1, spec.train.eval_tokens // T // jax.process_count())
    n_rows = max(rows, n_rows // rows * rows)
    docs = val_split.documents(jax.process_index(), jax.process_count())
    packed = data_lib.val_rows(docs, tok, T + 1, n_rows)
    n_rows = len(packed) // rows * rows
    if n_rows == 0:
      raise corpus.DataError(
          f"the validation split packs into {len(packed)} rows, fewer than one batch of "
          f"{rows}; use a larger corpus or a smaller train.device_batch_size")
    self.batches = packed[:n_rows].reshape(-1, rows, T + 1)
    self.mesh, self.eval_step = mesh, eval_step
    self.token_bytes = jnp.asarray(tok.token_bytes())

  def __call__(self, params) -> float:
    sums = []
    for b in self.batches:
      x = sharding.global_batch(b[:, :-1], self.mesh)
      y = sharding.global_batch(b[:, 1:], self.mesh)
      sums.append(self.eval_step(params, x, y, self.token_bytes))  # read once, at the end
    nats, n_bytes = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0)
    return bits_per_byte(nats, n_bytes)
