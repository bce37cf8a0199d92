"""Value modes: where an attention layer's value vector comes from.

A value mode is four orthogonal settings (the paper's four ablation axes, Section 4)
plus one flag:

  source   residual | x0 | v1 | table     what the context-free value V~ is
  combine  replace | add | gated_add | scale   how V~ meets V = x W_v
  coeff    fixed | learned                scalar coefficients, learned or not
  layers   last_third | every_other | all | second_half | last_two_thirds
           | "8,9,10,11"                  which layers are targets
  shared_table                            one table for every target layer

The paper's variants are named presets of these (the reference's `model_type`
names). Everything that depends on the mode -- which parameters a layer owns,
how its value is combined, how many value matmuls it runs, what a decoding
cache keeps for it -- is decided here, so the model, the FLOPs plan and the
cache never test flags of their own.
"""

from __future__ import annotations

import dataclasses
import math

SOURCES = ("residual", "x0", "v1", "table")
COMBINES = ("replace", "add", "gated_add", "scale")
COEFFS = ("fixed", "learned")
LAYER_RULES = ("last_third", "every_other", "all", "second_half", "last_two_thirds")
GATE_CHANNELS = 12  # the gated mode reads the first 12 channels of the layer input


class ValueModeError(ValueError):
  """A contradictory or unknown value-mode setting."""


@dataclasses.dataclass(frozen=True)
class ValueMode:
  source: str = "residual"
  combine: str = "replace"
  coeff: str = "fixed"
  layers: str = "last_third"
  shared_table: bool = False
  preset: str = ""

  @property
  def is_baseline(self) -> bool:
    return self.source == "residual" and self.combine == "replace"

  def settings(self) -> dict:
    """The four settings and the flag (what makes two modes the same mode)."""
    return _p(self.source, self.combine, self.coeff, self.layers, self.shared_table)

  def describe(self) -> str:
    return self.preset or f"{self.source}/{self.combine}/{self.coeff}/{self.layers}" + (
        "/shared" if self.shared_table else "")


def _p(source, combine, coeff, layers="last_third", shared_table=False):
  return dict(source=source, combine=combine, coeff=coeff, layers=layers,
              shared_table=shared_table)


# The reference's model_type names (its gpt.py variants) as four settings.
PRESETS = {
    "gpt_base": _p("residual", "replace", "fixed"),
    "gpt_base_v_scale_learn": _p("residual", "scale", "learned"),
    "gpt_base_v_from_v1_every_layer": _p("v1", "replace", "fixed", "all"),
    "gpt_base_v_from_v1_learn_every2": _p("v1", "replace", "learned", "every_other"),
    "gpt_base_v_from_v1": _p("v1", "replace", "fixed"),
    "gpt_base_v_from_v1_learn": _p("v1", "replace", "learned"),
    "gpt_base_v_from_x0_learn_every2": _p("x0", "replace", "learned", "every_other"),
    "gpt_base_v_from_x0": _p("x0", "replace", "fixed"),
    "gpt_base_v_from_x0_learn": _p("x0", "replace", "learned"),
    "gpt_base_add_init_v": _p("v1", "add", "fixed"),
    "gpt_base_add_init_v_learn": _p("v1", "add", "learned"),
    "gpt_base_add_init_res_v": _p("x0", "add", "fixed"),
    "gpt_base_add_init_res_v_learn": _p("x0", "add", "learned"),
    "gpt_base_v_from_value_emb_learn": _p("table", "replace", "learned"),
    "gpt_base_v_from_value_emb": _p("table", "replace", "fixed"),
    "gpt_base_v_from_value_emb_learn_shared": _p("table", "replace", "learned", shared_table=True),
    "gpt_base_v_from_value_emb_learn_every_layer": _p("table", "replace", "learned", "all"),
    "gpt_base_v_from_value_emb_learn_every2": _p("table", "replace", "learned", "every_other"),
    "gpt_base_v_from_value_emb_learn_second_half":
        _p("table", "replace", "learned", "second_half"),
    "gpt_base_v_from_value_emb_learn_last_two_thirds":
        _p("table", "replace", "learned", "last_two_thirds"),
    "gpt_base_add_init_value_emb": _p("table", "add", "fixed"),
    "gpt_base_add_init_value_emb_learn": _p("table", "add", "learned"),
    "gpt_base_add_init_value_emb_nanogpt": _p("table", "gated_add", "learned"),
    "gpt_base_add_init_value_emb_nanogpt_every2":
        _p("table", "gated_add", "learned", "every_other"),
}
BOV_PRESET = "gpt_base_v_from_value_emb_learn"


def mode_from_config(value_cfg, n_layer: int) -> ValueMode:
  """Turns `config.model.value` (a preset and/or the four settings) into a ValueMode.

  A preset supplies all four settings; any setting given explicitly (not None)
  overrides the preset's. Contradictions raise ValueModeError naming the
  settings and what is allowed.
  """
  get = (lambda k: value_cfg.get(k)) if hasattr(value_cfg, "get") else (
      lambda k: getattr(value_cfg, k, None))
  preset = get("preset") or ""
  if preset:
    if preset not in PRESETS:
      raise ValueModeError(
          f"model.value.preset={preset!r} is not a known variant; allowed: "
          + ", ".join(sorted(PRESETS)))
    settings = dict(PRESETS[preset])
  else:
    settings = _p("residual", "replace", "fixed")
  for key in ("source", "combine", "coeff", "layers", "shared_table"):
    if get(key) is not None:
      settings[key] = get(key)
  mode = ValueMode(preset=preset, **settings)
  check(mode, n_layer)
  # A preset whose settings were overridden no longer names the run's variant.
  if preset and PRESETS[preset] != mode.settings():
    mode = dataclasses.replace(mode, preset="")
  return mode


def _check_choice(name, value, allowed):
  if value not in allowed:
    raise ValueModeError(
        f"model.value.{name}={value!r} is not allowed; expected one of {', '.join(allowed)}")


def check(mode: ValueMode, n_layer: int) -> None:
  """Raises ValueModeError for an unknown or contradictory setting."""
  _check_choice("source", mode.source, SOURCES)
  _check_choice("combine", mode.combine, COMBINES)
  _check_choice("coeff", mode.coeff, COEFFS)
  if not isinstance(mode.shared_table, bool):
    raise ValueModeError(f"model.value.shared_table={mode.shared_table!r} must be true or false")
  if mode.source == "residual":
    if mode.combine == "replace" and mode.coeff != "fixed":
      raise ValueModeError(
          "model.value.source='residual' with combine='replace' is the baseline and takes "
          "coeff='fixed'; for a learned gamma*V use combine='scale', coeff='learned'")
    if mode.combine in ("add", "gated_add"):
      raise ValueModeError(
          f"model.value.combine={mode.combine!r} mixes V with a context-free V~, so "
          "model.value.source must be one of x0, v1, table (not 'residual')")
  if mode.combine == "scale":
    if mode.source != "residual":
      raise ValueModeError(
          "model.value.combine='scale' (gamma*V, no V~) needs model.value.source='residual'; "
          f"got source={mode.source!r}")
    if mode.coeff != "learned":
      raise ValueModeError(
          "model.value.combine='scale' needs model.value.coeff='learned' "
          "(a fixed scale of 1 is the baseline: source='residual', combine='replace')")
  if mode.combine == "gated_add" and mode.coeff != "learned":
    raise ValueModeError(
        "model.value.combine='gated_add' has a learned, input-dependent gate: "
        "model.value.coeff must be 'learned'")
  if mode.shared_table and mode.source != "table":
    raise ValueModeError(
        f"model.value.shared_table=True needs model.value.source='table'; got {mode.source!r}")
  layers = target_layers(mode, n_layer)  # raises on a bad layer spec
  if not mode.is_baseline and not layers:
    raise ValueModeError(
        f"model.value.layers={mode.layers!r} selects no target layer out of n_layer={n_layer}"
        + (" (with source='v1', layer 0 is never a target)" if mode.source == "v1" else ""))


def _layer_rule(rule: str, n_layer: int) -> list[int]:
  L = n_layer
  if rule == "last_third":
    return [i for i in range(L) if i >= (2 * L) // 3]
  if rule == "every_other":
    return [i for i in range(L) if i % 2 == (L - 1) % 2]
  if rule == "all":
    return list(range(L))
  if rule == "second_half":
    return [i for i in range(L) if i >= L // 2]
  if rule == "last_two_thirds":
    return [i for i in range(L) if i >= L // 3]
  try:
    ids = sorted({int(s) for s in rule.split(",") if s.strip()})
  except (ValueError, AttributeError):
    ids = None
  if not ids or any(not 0 <= i < L for i in ids):
    raise ValueModeError(
        f"model.value.layers={rule!r} is not allowed; expected one of {', '.join(LAYER_RULES)} "
        f"or a comma list of layer indices in [0, {L - 1}] such as \"{L - 1}\"")
  return ids


def target_layers(mode: ValueMode, n_layer: int) -> list[int]:
  """Layer indices whose value vector is modified; [] for the baseline."""
  if mode.is_baseline:
    return []
  layers = _layer_rule(mode.layers, n_layer)
  if mode.source == "v1":  # layer 0 produces V1, so it is never a target
    layers = [i for i in layers if i != 0]
  return layers


@dataclasses.dataclass(frozen=True)
class LayerValue:
  """What one attention layer does for its value vector."""
  target: bool
  source: str = "residual"
  combine: str = "replace"
  coeff: str = "fixed"

  @property
  def computes_v(self) -> bool:
    """Whether the layer owns a value matrix W_v (and a decoding cache keeps its values):
    replace from a table or from V1 leaves it without one. Its values are then a
    function of token ids (`is_bank`: gathered when the layer runs) or layer 0's
    (read from layer 0's cache)."""
    return not (self.target and self.combine == "replace" and self.source in ("table", "v1"))

  @property
  def is_bank(self) -> bool:
    """A Bank of Values layer: its value is (gamma times) its table's row for the token."""
    return self.target and self.combine == "replace" and self.source == "table"

  @property
  def uses_v(self) -> bool:  # V = x W_v reaches the output
    return not self.target or self.combine != "replace" or self.source == "residual"

  @property
  def value_matmuls(self) -> int:
    """How many times W_v is applied on the path to the loss (for FLOPs)."""
    return int(self.uses_v) + int(self.target and self.source == "x0")

  @property
  def coeff_names(self) -> tuple[str, ...]:
    if not self.target or self.coeff != "learned":
      return ()
    if self.combine in ("replace", "scale"):
      return ("gamma",)
    if self.combine == "add":
      return ("alpha", "beta")
    return ()

  @property
  def has_gate(self) -> bool:
    return self.target and self.combine == "gated_add"


def layer_plan(mode: ValueMode, n_layer: int) -> list[LayerValue]:
  targets = set(target_layers(mode, n_layer))
  return [LayerValue(True, mode.source, mode.combine, mode.coeff) if i in targets
          else LayerValue(False) for i in range(n_layer)]


def table_keys(mode: ValueMode, n_layer: int) -> dict[int, str]:
  """Target layer -> name of the table it reads (one name when shared)."""
  if mode.source != "table":
    return {}
  layers = target_layers(mode, n_layer)
  if mode.shared_table:
    return {i: "shared" for i in layers}
  return {i: f"layer_{i}" for i in layers}


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
  return int(math.ceil(vocab_size / multiple) * multiple)
