"""A target layer's value: what its value mode (settings/values.py) makes of the value
projected from the residual stream (v) and the value looked up or read elsewhere (v_tilde)."""

from __future__ import annotations

import jax

from bov_jax.settings import values

GATE_SCALE = 3.0    # g = 3 * sigmoid(x[..., :12] W_g)


def combine(layer_value: values.LayerValue, v, v_tilde, coeffs: dict, gate_input=None, gate_w=None):
  """The value a target layer attends over (the paper's Table 1 rows).

  v, v_tilde: [B, T, H_kv, dh] (v may be None where the layer has no W_v).
  coeffs: the layer's scalar coefficients by name; gate_input [B, T, >=12].
  """
  if not layer_value.target:
    return v
  learned = layer_value.coeff == "learned"
  if layer_value.combine == "scale":
    return coeffs["gamma"].astype(v.dtype) * v
  if layer_value.combine == "replace":
    return coeffs["gamma"].astype(v_tilde.dtype) * v_tilde if learned else v_tilde
  if layer_value.combine == "add":
    if learned:
      return coeffs["alpha"].astype(v.dtype) * v + coeffs["beta"].astype(v.dtype) * v_tilde
    return 0.5 * v + 0.5 * v_tilde
  if layer_value.combine == "gated_add":
    logits = gate_input[..., :values.GATE_CHANNELS] @ gate_w.astype(gate_input.dtype)
    g = GATE_SCALE * jax.nn.sigmoid(logits)  # [B, T, H_kv]
    return v + g[..., None].astype(v.dtype) * v_tilde
  raise AssertionError(layer_value.combine)
