"""From finished runs to the paper's tables and figures.

  python -m bov_jax.report RUN_DIR... --out=DIR     plots (PNG) and results.md
  python -m bov_jax.report RUN_DIR --coeffs         learned coefficients per layer (JSON)

Each RUN_DIR is a workdir: config.json, metrics.jsonl, checkpoints/, and
core.json when `--mode=eval --config.eval.core_bundle=...` ran on it.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from absl import app
from absl import flags
from etils import epath

from bov_jax import cli
from bov_jax import extras
from bov_jax import rundir

RESULTS = "results.md"  # the tables, beside the plots


def load_run(workdir: str) -> dict:
  from bov_jax import plan
  from bov_jax import spec as spec_lib
  cfg = rundir.config_of(workdir)
  spec = spec_lib.resolve(cfg)
  metrics = rundir.read_metrics(workdir)
  if metrics is None:
    raise FileNotFoundError(f"{workdir} has no {rundir.METRICS} (has it trained?)")
  core_file = rundir.core(workdir)
  core = json.loads(core_file.read_text()) if core_file.exists() else None
  return {"dir": workdir, "name": workdir.rstrip("/").rsplit("/", 1)[-1], "cfg": cfg,
          "mode": spec.model.value, "metrics": metrics, "core": core,
          "flops_per_token": plan.flops_per_token(spec.model),
          "targets": spec.model.target_layers}


def coefficients(workdir: str) -> dict:
  """{layer: {gamma|alpha|beta: value}} from the run's latest checkpoint."""
  from flax import nnx

  from bov_jax import checkpoint
  from bov_jax import model as model_lib
  from bov_jax import spec as spec_lib
  abstract = model_lib.abstract(spec_lib.resolve(rundir.config_of(workdir)).model)
  restored = checkpoint.Checkpoints(workdir, async_save=False).restore(
      nnx.to_pure_dict(nnx.state(abstract)))
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


def _define_flags():
  """The command's flags, defined only when it runs as a command (the module is a
  library too)."""
  flags.DEFINE_string("out", None, "where to write PNGs and results.md")
  flags.DEFINE_bool("coeffs", False, "print learned coefficients as JSON")


def main(argv) -> int:
  """argv[1:]: run directories (workdirs)."""
  runs = argv[1:]
  if not runs:
    raise app.UsageError("give one or more run directories")
  try:
    if flags.FLAGS.coeffs:
      for d in runs:
        print(json.dumps({"run": d, **coefficients(d)}))
      return 0
    if not flags.FLAGS.out:
      raise app.UsageError("--out=DIR is required (or --coeffs)")
    loaded = [load_run(d) for d in runs]
  except (ValueError, OSError) as e:  # bad input (2), or the environment failed (1)
    return cli.failed(e)
  out = epath.Path(flags.FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / RESULTS).write_text(markdown_table(loaded))  # the tables need no plotting library
  written = [str(out / RESULTS)]
  try:
    written = plots(loaded, flags.FLAGS.out) + written
  except extras.MissingExtra as e:
    print(f"error: {e} ({RESULTS} is written: {out / RESULTS})", file=sys.stderr)
    return extras.EXIT
  print(json.dumps({"written": written}))
  return 0


if __name__ == "__main__":
  _define_flags()
  cli.run(lambda argv: sys.exit(main(argv)))
