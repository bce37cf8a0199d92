"""The configuration of a bov_jax model for Hugging Face transformers (5.x).

bov_jax.export copies this file into every folder it writes, beside
modeling_bov_gpt.py; config.json's `auto_map` points transformers here, so
`AutoConfig.from_pretrained(FOLDER, trust_remote_code=True)` reads a BovGPTConfig.
The fields are bov_jax's resolved model: the per-layer windows, the value mode of the
paper (Section 4: source, combine, coefficient, layers) and the layers it targets, and
the constants of the forward pass, written by the exporter from bov_jax's own.
"""

from transformers import PreTrainedConfig


class BovGPTConfig(PreTrainedConfig):
  model_type = "bov_gpt"
  keys_to_ignore_at_inference = ["cache"]

  vocab_size: int = 65536
  padded_vocab_size: int | None = None     # rows of wte, lm_head and the value tables
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 6
  num_key_value_heads: int | None = None
  head_dim: int | None = None
  max_position_embeddings: int = 2048
  window_sizes: list | None = None         # per layer: query i sees key j iff 0 <= i - j <= w
  value_mode: dict | None = None           # source, combine, coeff, layers, shared_table, preset
  value_layers: list | None = None         # the layers whose value the mode changes
  rope_theta: float = 100000.0
  logit_softcap: float = 15.0              # logits = c * tanh(z / c)
  qk_norm_scale: float = 1.2
  smear_channels: int = 24
  gate_channels: int = 12                  # gated_add: g = gate_scale * sigmoid(x[:12] W_g)
  gate_scale: float = 3.0
  use_cache: bool = True
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  tie_word_embeddings: bool = False

  def __post_init__(self, **kwargs):
    if self.num_key_value_heads is None:
      self.num_key_value_heads = self.num_attention_heads
    if self.head_dim is None:
      self.head_dim = self.hidden_size // self.num_attention_heads
    if self.padded_vocab_size is None:
      self.padded_vocab_size = self.vocab_size
    if self.window_sizes is None:
      self.window_sizes = [self.max_position_embeddings] * self.num_hidden_layers
    if self.value_mode is None:
      self.value_mode = {"source": "residual", "combine": "replace", "coeff": "fixed",
                         "layers": "last_third", "shared_table": False, "preset": "gpt_base"}
    if self.value_layers is None:
      self.value_layers = []
    super().__post_init__(**kwargs)
