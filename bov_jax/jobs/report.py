"""From finished runs to the paper's tables and figures (the command
`python -m bov_jax.report`).

Each RUN_DIR is a workdir: config.json, metrics.jsonl, checkpoints/, and
core.json when `--mode=eval --config.eval.core_bundle=...` ran on it.
"""

from __future__ import annotations

import json

import numpy as np
from etils import epath
from flax import nnx

from bov_jax.host import extras
from bov_jax.model import gpt as model_lib
from bov_jax.run import plan
from bov_jax.run import spec as spec_lib
from bov_jax.store import checkpoint
from bov_jax.store import rundir

RESULTS = "results.md"  # the tables, beside the plots


def load_run(workdir: str) -> dict:
  cfg = rundir.config_of(workdir)
  model = spec_lib.model_of(cfg)
  metrics = rundir.read_metrics(workdir)
  if metrics is None:
    raise FileNotFoundError(f"{workdir} has no {rundir.METRICS} (has it trained?)")
  core_file = rundir.core(workdir)
  core = json.loads(core_file.read_text()) if core_file.exists() else None
  return {"dir": workdir, "name": workdir.rstrip("/").rsplit("/", 1)[-1], "cfg": cfg,
          "mode": model.value, "metrics": metrics, "core": core,
          "flops_per_token": plan.flops_per_token(model), "targets": model.target_layers}


def coefficients(workdir: str) -> dict:
  """{layer: {gamma|alpha|beta: value}} from the run's latest checkpoint."""
  abstract = model_lib.abstract(spec_lib.model_of(rundir.config_of(workdir)))
  with checkpoint.Checkpoints(workdir, async_save=False) as ckpts:
    restored = ckpts.restore(nnx.to_pure_dict(nnx.state(abstract)))
  if restored is None:
    raise FileNotFoundError(f"no checkpoint under {rundir.checkpoints(workdir)}")
  step, params = restored.step, restored.params
  model = nnx.merge(nnx.graphdef(abstract), params)
  out = {}
  for i, block in enumerate(model.blocks):
    if len(block.attn.coeffs):
      out[i] = {k: float(v[...]) for k, v in block.attn.coeffs.items()}
  return {"step": step, "layers": out}


def _final_bpb(run):
  vals = [m["val_bpb"] for m in run["metrics"] if "val_bpb" in m]
  return vals[-1] if vals else float("nan")


def markdown_table(runs) -> str:
  lines = ["| run | variant | source | combine | layers | coefficient | final val bpb | CORE |",
           "|---|---|---|---|---|---|---|---|"]
  for r in runs:
    m = r["mode"]
    core = f"{r['core']['core']:.4f}" if r["core"] else ""
    layers = ",".join(map(str, r["targets"])) or "-"
    lines.append(f"| {r['name']} | {m.preset or '(custom)'} | {m.source} | {m.combine} | "
                 f"{layers} | {m.coeff} | {_final_bpb(r):.4f} | {core} |")
  return "\n".join(lines) + "\n"


def cache_saved_bytes(n_bank: int, kv_dim: int, vocab: int, contexts, bytes_per_element=2):
  """Paper Eq. 6 per sequence: bank layers keep no values; their tables cost |V| rows."""
  return [n_bank * kv_dim * (t - vocab) * bytes_per_element for t in contexts]


def _save(fig, out: str, name: str) -> str:
  """A figure as PNG under `out` (a directory or a bucket prefix); its path."""
  import io

  plt = extras.require("matplotlib.pyplot", "report", "plotting")
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=120)
  plt.close(fig)
  path = epath.Path(out) / name
  path.write_bytes(buf.getvalue())
  return str(path)


def plots(runs, out: str) -> list[str]:
  extras.require("matplotlib", "report", "python -m bov_jax.report's plots").use("Agg")
  plt = extras.require("matplotlib.pyplot", "report", "plotting")
  written = []
  # Figure 4: validation bpb against tokens and against FLOPs
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for r in runs:
    pts = [(m.get("tokens", 0), m["val_bpb"]) for m in r["metrics"] if "val_bpb" in m]
    if not pts:
      continue
    tok, bpb = zip(*pts)
    axes[0].plot(tok, bpb, marker="o", ms=3, label=r["name"])
    axes[1].plot(np.array(tok) * r["flops_per_token"], bpb, marker="o", ms=3, label=r["name"])
  axes[0].set_xlabel("tokens")
  axes[1].set_xlabel("FLOPs")
  for a in axes:
    a.set_ylabel("validation bpb")
    a.grid(alpha=0.3)
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  written.append(_save(fig, out, "val_bpb.png"))
  # Figure 2: learned coefficients per layer
  coeff_runs = [(r, coefficients(r["dir"])) for r in runs if r["mode"].coeff == "learned"
                and r["mode"].combine != "gated_add"]
  if coeff_runs:
    fig, ax = plt.subplots(figsize=(6, 4))
    for r, c in coeff_runs:
      for name in ("gamma", "alpha", "beta"):
        layers = [layer for layer in c["layers"] if name in c["layers"][layer]]
        if layers:
          ax.plot(layers, [c["layers"][layer][name] for layer in layers], marker="o",
                  label=f"{r['name']}: {name}")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("coefficient")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out, "coefficients.png"))
  # Figure 5a: value-cache memory saved per sequence against context length
  fig, ax = plt.subplots(figsize=(6, 4))
  contexts = np.logspace(np.log10(256), np.log10(262144), 40)
  seen = set()
  for r in runs:
    if r["mode"].source != "table":
      continue
    m = r["cfg"].model
    key = (len(r["targets"]), m.n_kv_head * (m.n_embd // m.n_head), m.vocab_size)
    if key in seen:
      continue
    seen.add(key)
    saved = np.array(cache_saved_bytes(*key, contexts)) / 2 ** 20
    ax.plot(contexts, saved, label=f"{key[0]} bank layers, kv {key[1]}, |V|={key[2]}")
  ax.axhline(0, color="k", lw=0.5)
  ax.set_xscale("log")
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("value cache saved per sequence (MiB, bf16)")
  if seen:
    ax.legend(fontsize=7)
  fig.tight_layout()
  written.append(_save(fig, out, "cache_memory.png"))
  return written


def write(runs: list[dict], out: str) -> list[str]:
  """results.md, then the plots, under OUT; returns the files written. Without the
  plotting extra the tables are written and MissingExtra says what is missing."""
  root = epath.Path(out)
  root.mkdir(parents=True, exist_ok=True)
  (root / RESULTS).write_text(markdown_table(runs))  # the tables need no plotting library
  try:
    return plots(runs, out) + [str(root / RESULTS)]
  except extras.MissingExtra as e:
    raise extras.MissingExtra(f"{e} ({RESULTS} is written: {root / RESULTS})") from None
