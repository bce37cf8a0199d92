"""What a run records: metrics.jsonl, TensorBoard event files, optionally Weights &
Biases, and the throughput behind tokens/s and MFU.

Only process 0 writes. metrics.jsonl gets one JSON object per logged step, appended;
a resumed run first cuts the lines past the step it resumed from (they are about to be
logged again), so the file reads as one run. TensorBoard (tensorboardX) writes event
files into the run directory under the tags in TAGS, and is told to purge the
steps a resume repeats. W&B runs only when `log.wandb_project` is set.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import jax

from bov_jax.host import extras
from bov_jax.store import rundir
from bov_jax.store import storage

# record key -> TensorBoard / W&B tag
TAGS = {
    "train_loss": "train/loss", "lr": "train/lr", "tokens": "train/tokens",
    "val_bpb": "val/bpb", "core": "val/core",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "compile_s": "perf/compile_s",
    "data_wait_s": "perf/data_wait_s", "eval_s": "perf/eval_s",
}

# Dense bf16 datasheet peaks, FLOP/s per chip.
DATASHEET_PEAK = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
}


def measured_cpu_peak(n: int = 1024, repeats: int = 5, seconds: float = 0.5) -> float:
  """The best of large fp32 matmuls on this host, FLOP/s: at least `repeats` of them
  and for at least `seconds` (on a shared host a few alone can read half the peak)."""
  import jax.numpy as jnp
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(a).block_until_ready()
  best, start, k = 0.0, time.perf_counter(), 0
  while k < repeats or time.perf_counter() - start < seconds:
    t = time.perf_counter()
    f(a).block_until_ready()
    best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    k += 1
  return best


_PEAK_CACHE = {}


def peak_flops(device=None, again: bool = False) -> float:
  """Peak FLOP/s of one device: datasheet on TPU/GPU, measured on CPU (`again`: measured
  anew, the best of both kept)."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    if "cpu" not in _PEAK_CACHE or again:
      _PEAK_CACHE["cpu"] = max(_PEAK_CACHE.get("cpu", 0.0), measured_cpu_peak())
    return _PEAK_CACHE["cpu"]
  kind = getattr(device, "device_kind", "")
  for name, value in DATASHEET_PEAK.items():
    if name.lower() in kind.lower():
      return value
  return float("nan")


class Throughput:
  """tokens/s and MFU over the steps since the last logged one, counting neither the
  first step (compilation) nor time spent evaluating."""

  def __init__(self, tokens_per_step: int, flops_per_token: int, peak_flops: float,
               remeasure=None):
    self.tokens_per_step, self.flops_per_token, self.peak = (
        tokens_per_step, flops_per_token, peak_flops)
    self.remeasure = remeasure  # a measured peak's new measurement (CPU), or None
    self.start, self.steps, self.excluded, self.data_wait = None, 0, 0.0, 0.0

  def begin(self):
    """The clock starts (after the first step has run)."""
    self.start, self.steps, self.excluded, self.data_wait = time.perf_counter(), 0, 0.0, 0.0

  def step_done(self, data_wait_s: float = 0.0):
    self.steps += 1
    self.data_wait += data_wait_s

  def exclude(self, seconds: float):
    self.excluded += seconds

  def read(self) -> dict:
    """The window's numbers (empty before the clock started or with no step in it); the
    next window starts now."""
    if self.start is None or self.steps == 0:
      return {}
    dt = max(time.perf_counter() - self.start - self.excluded, 1e-9)
    tps = self.steps * self.tokens_per_step / dt
    if self.remeasure is not None and tps * self.flops_per_token > self.peak:
      # a peak measured while another process shared the CPU reads low: measured again,
      # and never below what the run itself has done
      self.peak = max(self.remeasure(), tps * self.flops_per_token)
    out = {"tokens_per_s": tps, "mfu": tps * self.flops_per_token / self.peak,
           "data_wait_s": self.data_wait / self.steps}
    self.begin()
    return out


class Writer:
  """metrics.jsonl, TensorBoard and (optionally) W&B for one run; a no-op off process 0
  or without a workdir."""

  def __init__(self, workdir: str | None, resume_step: int, log_cfg, config_dict: dict):
    self.on = bool(workdir) and jax.process_index() == 0
    self.jsonl = self.tb = self.wandb = None
    if not self.on:
      return
    root = rundir.path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    # a missing extra is named before any file is opened
    wandb = extras.require("wandb", "wandb", "log.wandb_project") if log_cfg.wandb_project else None
    self.jsonl = rundir.metrics(workdir)
    _cut_after(self.jsonl, resume_step)
    if log_cfg.tensorboard:
      # a resume's own file (names carry the second they were made in, and the step)
      self.tb = _tensorboardx().SummaryWriter(
          logdir=str(root), purge_step=resume_step + 1 if resume_step else None,
          flush_secs=30, filename_suffix=f".step{resume_step}")
    if wandb is not None:
      run_id = hashlib.sha1(str(root).encode()).hexdigest()[:16]  # one W&B run per workdir
      self.wandb = wandb.init(project=log_cfg.wandb_project, entity=log_cfg.wandb_entity or None,
                              name=os.path.basename(str(root).rstrip("/")), id=run_id,
                              resume="allow", config=config_dict)

  def write(self, record: dict) -> None:
    if not self.on:
      return
    storage.append_text(str(self.jsonl), json.dumps(record) + "\n")
    step = record["step"]
    scalars = {TAGS[k]: float(v) for k, v in record.items() if k in TAGS}
    if self.tb is not None:
      for tag, value in scalars.items():
        self.tb.add_scalar(tag, value, step)
    if self.wandb is not None:
      self.wandb.log(scalars, step=step)

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()
    if self.wandb is not None:
      self.wandb.finish()


class _BucketEventFile:
  """An event file in a bucket: written whole at every flush, as tensorboardX's own GCS
  writer does (that one needs google-cloud-storage's client; this goes through gcsfs)."""

  def __init__(self, path: str):
    self.path, self.data = path, bytearray()

  def write(self, b):
    self.data += b

  def flush(self):
    fs, p = storage.filesystem(self.path)
    fs.pipe(p, bytes(self.data))

  def close(self):
    self.flush()


class _BucketEventFiles:
  def open(self, path):
    return _BucketEventFile(path)

  def directory_check(self, path):  # a bucket needs no directories
    pass


def _tensorboardx():
  """tensorboardX, its event files to buckets through gcsfs. Imported without torch:
  tensorboardX imports torch where it is installed only to accept torch tensors, 4 s at
  each start (docs/performance.md); this writes floats."""
  hidden = "torch" not in sys.modules
  if hidden:
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
  try:
    import tensorboardX
    from tensorboardX import record_writer
  finally:
    if hidden:
      del sys.modules["torch"]
  record_writer.register_writer_factory("gs", _BucketEventFiles())
  return tensorboardX


def _cut_after(p, step: int) -> None:
  """Drops the lines of metrics.jsonl past `step` (logged before a crash, logged again
  after the resume)."""
  if not p.exists():
    return
  text = p.read_text()
  offset = 0
  for line in text.splitlines(keepends=True):
    if line.strip() and json.loads(line).get("step", 0) > step:
      break
    offset += len(line)
  if offset < len(text):
    p.write_text(text[:offset])


def progress_line(record: dict, num_iterations: int, tokens_per_step: int) -> str:
  step = record["step"]
  parts = [f"step {step}/{num_iterations}"]
  if "train_loss" in record:
    parts.append(f"loss {record['train_loss']:.4f}")
  if "lr" in record:
    parts.append(f"lr x{record['lr']:.3f}")
  if "compile_s" in record:
    parts.append(f"compiled in {record['compile_s']:.1f}s")
  if "tokens_per_s" in record:
    tps = record["tokens_per_s"]
    eta = (num_iterations - step) * tokens_per_step / max(tps, 1e-9)
    parts += [f"{tps:,.0f} tok/s", f"mfu {100 * record['mfu']:.1f}%", f"eta {fmt_time(eta)}"]
  if "val_bpb" in record:
    parts.append(f"val_bpb {record['val_bpb']:.4f}")
  return " | ".join(parts)


def fmt_time(s: float) -> str:
  s = int(s)
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
