"""vLLM's CPU build serving an exported folder through its Transformers backend: what
`benchmarks/serve.py --systems=vllm` runs in vLLM's own environment (Python 3.11, the CPU
build of torch; vLLM's pins conflict with this project's, so nothing of bov_jax is
imported here).

  VLLM_PYTHON -m benchmarks.serve_vllm --folder=FOLDER --requests=REQS.json --out=OUT.json
      [--slots=32] [--cache_bytes=N] [--check=N]

REQS.json: {"requests": [{"prompt": [ids], "max_tokens": n}, ...]}. Every request is
decoded greedily to its max_tokens (ignore_eos), all submitted at once (vLLM's offline
throughput benchmark); OUT.json gets output tokens/s, time to first token p50/p99, each
request's tokens, and vLLM's cache bytes per position.

The folder's model runs as transformers builds it (AutoModel from its own code, every
attention module dispatching through `ALL_ATTENTION_FUNCTIONS`), with what the backend
needs told through vLLM's own hooks:
- hf_overrides: one attention layer more than the model has (the smear gate's
  `PreviousToken`, reading the previous token from vLLM's cache), the short-window layers
  as `sliding_attention` (vLLM's window counts the query's own position, bov_jax's
  window does not: w + 1), and the logits' soft cap under its transformers name;
- a subclass of the backend's causal LM, registered for the folder's architecture: its
  LM head loads the folder's `lm_head` [D, V] as vLLM's [V, D] `lm_head.weight`, and the
  model's raw `wte` is no nn.Embedding for vLLM to replace.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def register(architecture: str) -> None:
  """The Transformers backend's causal LM with the folder's head layout, registered for
  the folder's architecture (vLLM imported here: the pure functions below run without it)."""
  from vllm import ModelRegistry
  from vllm.model_executor.models.transformers import TransformersForCausalLM

  class BovTransformersForCausalLM(TransformersForCausalLM):

    def _vocab_embeddings(self):
      return set()  # `wte` is a raw parameter the model indexes itself

    def load_weights(self, weights):
      vocab = self.text_config.vocab_size

      def renamed(pairs):
        for name, w in pairs:
          yield (("lm_head.weight", w.t()[:vocab].contiguous()) if name == "lm_head"
                 else (name, w))

      return super().load_weights(renamed(weights))

  ModelRegistry.register_model(architecture, BovTransformersForCausalLM)


def overrides(config: dict) -> dict:
  """vLLM's view of the folder's config.json (see the module docstring)."""
  context, windows = config["max_position_embeddings"], config["window_sizes"]
  short = sorted({w for w in windows if w < context})
  if len(short) > 1:
    raise ValueError(f"window_sizes {windows}: vLLM's backend takes one sliding window")
  types = ["sliding_attention" if w < context else "full_attention" for w in windows]
  out = {"num_hidden_layers": len(windows) + 1, "layer_types": types + ["full_attention"],
         "final_logit_softcapping": config["logit_softcap"]}
  if short:
    out["sliding_window"] = short[0] + 1
  return out


def cache_bytes_per_position(config: dict, dtype_bytes: int) -> int:
  """vLLM's cache: keys and values of every attention layer, the smear's included."""
  return (len(config["window_sizes"]) + 1) * 2 * (config["num_key_value_heads"] *
                                                  config["head_dim"] * dtype_bytes)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--folder", required=True)
  ap.add_argument("--requests", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--cache_bytes", type=int, default=None)
  args = ap.parse_args()
  with open(os.path.join(args.folder, "config.json")) as f:
    config = json.load(f)
  with open(args.requests) as f:
    reqs = json.load(f)["requests"]
  os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the class registered here
  from vllm import LLM
  from vllm import SamplingParams
  from vllm import TokensPrompt
  register(config["architectures"][0])
  longest = max(len(r["prompt"]) + r["max_tokens"] for r in reqs)
  kwargs = {}
  if args.cache_bytes:
    kwargs["kv_cache_memory_bytes"] = args.cache_bytes
  llm = LLM(model=args.folder, trust_remote_code=True, dtype="float32",
            hf_overrides=overrides(config), max_num_seqs=args.slots,
            max_model_len=min(config["max_position_embeddings"], max(longest, 64)),
            skip_tokenizer_init=True, seed=0, disable_log_stats=False, **kwargs)
  prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs]
  params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True,
                           detokenize=False) for r in reqs]
  llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm up
  t0 = time.perf_counter()
  outs = llm.generate(prompts, params, use_tqdm=False)
  wall = time.perf_counter() - t0
  tokens = [list(o.outputs[0].token_ids) for o in outs]
  # vLLM's own per-request stats: seconds from arrival (all at t0) to the first token
  ttft = [o.metrics.first_token_latency for o in outs if getattr(o, "metrics", None)]
  n_out = sum(len(t) for t in tokens)
  rec = {"system": "vllm", "requests": len(reqs), "output_tokens": n_out,
         "seconds": round(wall, 3), "tokens_per_s": round(n_out / wall, 1),
         "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3) if ttft else None,
         "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3) if ttft else None,
         "max_num_seqs": args.slots,  # vLLM's cap; what it held in flight it does not report here
         "cache_bytes_per_position": cache_bytes_per_position(config, 4),
         "tokens": tokens}
  with open(args.out, "w") as f:
    json.dump(rec, f)


if __name__ == "__main__":
  main()
