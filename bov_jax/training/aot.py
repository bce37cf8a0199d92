"""Ahead-of-time compilation for a TPU slice, on any host (`--mode=compile`).

With libtpu installed (`pip install '.[tpu]'`), `jax.experimental.topologies` describes the
chips of a slice without owning one, and a jitted function lowered with shardings over them
compiles with the TPU compiler itself, which reports each chip's memory (`memory_analysis`)
and refuses a program that overflows HBM. This builds a run's programs exactly as
`--mode=train` and `--mode=sample` build them on that slice (the spec resolved for TPU, its
mesh, batch layout, shardings, optimizer and abstract state: nothing is allocated) and
compiles each: the train step, the eval step, and decoding's prefill and decode step over a
cache of `model.sequence_len` positions. MaxText's `train_compile.py` is the model.

Compile-only devices report no memory size, so HBM per chip comes from
`topology.CHIPS` (what the compiler says a chip has for programs when one overflows). The persistent
compilation cache is neither read nor written: `compile_s` is a real compile.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from bov_jax.inference import generate as inference
from bov_jax.model import gpt as model_lib
from bov_jax.model import kvcache
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.parallel import topology as topology_lib
from bov_jax.run import plan
from bov_jax.run import spec as spec_lib
from bov_jax.training import step as step_lib

GiB = topology_lib.GiB
FIT = 0.9  # a program fits when its peak is at most this share of HBM


def target(cfg, topology_name: str):
  """(cfg for the target, the target's name): --topology=2xv5p-64 sets mesh.slices=2,
  and --topology=v5p-64 with mesh.slices=2 names 2xv5p-64; TopologyError where the two
  disagree."""
  name = topology_lib.with_slices(topology_name, cfg.mesh.slices)
  cfg = cfg.copy_and_resolve_references()
  cfg.mesh.slices = topology_lib.split_slices(name)[0]
  return cfg, name


def spec_for(cfg, topology_name: str):
  """The run spec of `cfg` for TPU slices (gcloud's name, v5p-64 or 2xv5p-64, with
  mesh.slices): resolved for their chips, the fused decode kernel decided by compiling
  it for one of them."""
  cfg, name = target(cfg, topology_name)
  devices, _ = topology_lib.devices(name)
  return spec_lib.resolve(cfg, backend="tpu", n_devices=len(devices), device=devices[0])


def memory(compiled) -> dict:
  """Bytes per chip of a compiled program: arguments, outputs, temporaries, generated
  code, aliased (outputs written over donated arguments), and the peak (the compiler's
  own figure where it reports one, else their sum less the aliasing)."""
  m = compiled.memory_analysis()
  out = {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
         "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
         "code_bytes": int(m.generated_code_size_in_bytes)}
  peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  out["peak_bytes"] = peak or (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                               + out["code_bytes"] - out["alias_bytes"])
  out["peak_counts"] = "live" if peak else "sum"
  return out


class Overflow(Exception):
  """The compiler refused a program for HBM."""


def compile_lowered(lowered) -> tuple[dict, object]:
  """(memory and compile seconds, the compiled program); Overflow where HBM is short."""
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001 - the compiler's out-of-memory is a plain error
    if "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e):
      raise Overflow(str(e).splitlines()[0][:300]) from None
    raise
  return dict(memory(compiled), compile_s=round(time.perf_counter() - t0, 2)), compiled


# -- the programs --------------------------------------------------------------------

def _sds(shape, dtype, mesh, logical):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
      mesh, sharding.logical_to_spec(logical, shape, mesh)))


def train_programs(spec, mesh):
  """{name: lowered} for the train and eval steps, as step.build makes them."""
  trainer = step_lib.build(spec, mesh, plan.num_iterations(spec), init=False)
  layout, T = trainer.layout, spec.model.sequence_len
  rows = layout.rows_per_device * mesh.size
  batch = jax.ShapeDtypeStruct((layout.accum, rows, T), jnp.int32,
                               sharding=sharding.batch_sharding(mesh, leading_dims=2))
  tokens = jax.ShapeDtypeStruct((rows, T), jnp.int32, sharding=sharding.batch_sharding(mesh))
  token_bytes = _sds((spec.model.vocab_size,), jnp.int32, mesh, (None,))
  grads = jax.tree.map(lambda p, s: p.update(sharding=s), trainer.params, trainer.grad_shardings)
  with jax.set_mesh(mesh):
    return trainer.layout, {
        "train_step": trainer.train_step.lower(trainer.params, trainer.opt_state, batch, batch),
        "eval_step": trainer.eval_step.lower(trainer.params, tokens, tokens, token_bytes),
        "update_step": trainer.update_step.lower(grads, trainer.opt_state, trainer.params)}


class Decoding:
  """Decoding's programs for one batch size (prefill chunks and the decode step), over
  a cache of the model's context, the cache donated."""

  def __init__(self, spec, mesh):
    self.mesh = mesh
    self.model_spec = spec.model  # its decode kernel decided for the slice (spec.resolve)
    self.graphdef, self.params, _ = params_lib.abstract_params(spec.model, mesh)
    self.abstract = model_lib.abstract(self.model_spec)
    self.unit = math.prod(mesh.shape[a] for a in sharding.batch_axes(mesh, 0))

  def cache(self, batch: int):
    shapes = jax.eval_shape(lambda: kvcache.init(self.abstract, batch,
                                                 self.model_spec.sequence_len))
    return jax.tree.map(lambda x, ax: _sds(x.shape, x.dtype, self.mesh, ax), shapes,
                        kvcache.logical_axes(shapes))

  def prefill(self, batch: int, chunk: int):
    """A chunk of `chunk` tokens of `batch` sequences run into the cache."""
    graphdef = self.graphdef
    fn = jax.jit(lambda p, ids, c: inference.extend(nnx.merge(graphdef, p), ids, c),
                 donate_argnums=(2,))
    ids = _sds((batch, chunk), jnp.int32, self.mesh, ("batch", None))
    with jax.set_mesh(self.mesh):
      return fn.lower(self.params, ids, self.cache(batch))

  def decode_step(self, batch: int):
    graphdef = self.graphdef
    fn = jax.jit(lambda p, last, c, key: inference.decode_step(nnx.merge(graphdef, p), last, c,
                                                               key), donate_argnums=(2,))
    last = _sds((batch, self.model_spec.vocab_size), jnp.float32, self.mesh, ("batch", None))
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype,
                               sharding=NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    with jax.set_mesh(self.mesh):
      return fn.lower(self.params, last, self.cache(batch), key)

  def cache_bytes_per_sequence(self) -> int:
    shapes = jax.eval_shape(lambda: kvcache.init(self.abstract, 1, self.model_spec.sequence_len))
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(shapes))


def _try(lowered_fn):
  """A program's figures, or None where it overflows HBM."""
  try:
    return compile_lowered(lowered_fn())[0]
  except Overflow:
    return None


def max_decode_batch(dec: Decoding, limit: int, log=print) -> tuple[int, dict | None]:
  """The largest global batch (a multiple of the devices the batch is split over) whose
  decode step peaks at <= limit bytes per chip, and that step's figures (0 and the
  smallest batch's, None where it overflows, when none fits). The peak grows linearly
  with the batch (the cache), so two compiles aim at the limit and a few more confirm it."""
  u = dec.unit
  first = _try(lambda: dec.decode_step(u))
  if not _fits(first, limit):
    return 0, first
  found = {u: first}
  lo, hi = u, None  # the largest batch known to fit, the smallest known not to
  guess = 2 * u
  for _ in range(10):
    if hi is not None and hi - lo <= u:
      break
    guess = max(lo + u, min(guess, hi - u) if hi is not None else guess) // u * u
    m = _try(lambda g=guess: dec.decode_step(g))
    log(f"  decode_step at batch {guess}: " + ("overflows HBM" if m is None else
                                               f"peak {m['peak_bytes'] / GiB:.2f} GiB"))
    if _fits(m, limit):
      slope = (m["peak_bytes"] - found[lo]["peak_bytes"]) / (guess - lo)
      found[guess], lo = m, guess
      room = (limit - m["peak_bytes"]) / slope if slope > 0 else guess
      guess = lo + max(u, int(room) // u * u)
    else:
      hi = guess
      guess = (lo + hi) // 2
  return lo, found[lo]


# -- the mode --------------------------------------------------------------------------

PROGRAMS = ("train", "eval", "decode", "update")  # update: the train step's optimizer part
# What lowers each program's bytes per chip.
LOWER_TRAIN = ("model.remat (dots_no_batch, then full), train.device_batch_size, or a mesh "
               "that splits more (mesh.fsdp, mesh.tensor)")
LOWER_DECODE = "a mesh that splits more (mesh.fsdp, mesh.tensor), or a shorter model.sequence_len"


def memory_line(name: str, m: dict, hbm: int | None = None) -> str:
  """One line of a program's bytes per chip (and its compile seconds where measured). The
  compiler's peak is what is live at once; temporaries, all allocated (buffers take turns)."""
  of = f" of {hbm / GiB:.2f} GiB HBM ({100 * m['peak_bytes'] / hbm:.0f}%)" if hbm else " per device"
  counts = {"live": "the most live at once"}.get(m.get("peak_counts", "live"),
                                                 "the parts summed, the compiler gives no peak")
  line = (f"{name}: peak {m['peak_bytes'] / GiB:.2f} GiB{of} ({counts}) | allocated: arguments "
          f"{m['argument_bytes'] / GiB:.2f}, outputs {m['output_bytes'] / GiB:.2f}, temporaries "
          f"{m['temp_bytes'] / GiB:.2f}, code {m['code_bytes'] / GiB:.2f} GiB")
  return line + (f" | compile {m['compile_s']:.1f} s" if "compile_s" in m else "")


def run(spec, topology: str, programs=("train", "eval", "decode"), log=print,
        on_compiled=None) -> dict:
  """Compiles the run's programs for a TPU slice; returns the report (`fits` and each
  program's bytes per chip and compile seconds). Raises TopologyError for an unknown
  slice or no TPU compiler. on_compiled(name, compiled): sees each step it compiles."""
  unknown = sorted(set(programs) - set(PROGRAMS))
  if unknown:
    raise ValueError(f"--programs: unknown {', '.join(unknown)}; expected a comma list "
                     f"of {', '.join(PROGRAMS)}")
  topology = topology_lib.with_slices(topology, spec.mesh.slices)
  devs, chip = topology_lib.devices(topology)
  hbm, limit = chip.hbm_bytes, int(FIT * chip.hbm_bytes)
  mesh = sharding.make_mesh(spec.mesh, devs)
  m = spec.model
  report = {"topology": topology, "chips": len(devs), "slices": spec.mesh.slices,
            "peak_flops": chip.peak_flops, "device_kind": devs[0].device_kind,
            "hbm_bytes_per_chip": hbm, "mesh": dict(mesh.shape),
            "spec": {"attention": m.attention, "remat": m.remat, "scan": m.scan,
                     "stages": [list(dataclasses.astuple(s)) for s in m.stages],
                     "loss_chunk": m.loss_chunk, "dtype": m.dtype,
                     "device_batch_size": spec.train.device_batch_size},
            "fits": True, "programs": {}}
  out = report["programs"]
  failed = []

  def add(name, lowered_fn):
    try:
      fig, compiled = compile_lowered(lowered_fn())
      if on_compiled:
        on_compiled(name, compiled)
    except Overflow as e:
      fig = {"peak_bytes": None, "error": str(e)}
    fig["fits"] = _fits(fig, limit)
    out[name] = fig
    if fig["peak_bytes"] is None:
      log(f"{name}: does not compile: {fig['error']}")
    else:
      log(memory_line(name, fig, hbm))
    if not fig["fits"]:
      failed.append(name)
    return fig

  if {"train", "eval", "update"} & set(programs):
    layout, lowered = train_programs(spec, mesh)
    report["spec"].update(rows_per_device=layout.rows_per_device, accum=layout.accum)
    for name in ("train", "eval", "update"):
      if name in programs:
        add(f"{name}_step", lambda name=name: lowered[f"{name}_step"])
  if "decode" in programs:
    decoding(Decoding(spec, mesh), limit, hbm, report, failed, log)
  report["fits"] = not failed
  report["failed"] = failed
  return report


MIN_CHUNK = 128  # prefill chunks: the whole context, halved down to this many tokens


def _fits(fig, limit) -> bool:
  """The one rule: a program fits when it compiled and peaks at most `limit` bytes."""
  return fig is not None and fig["peak_bytes"] is not None and fig["peak_bytes"] <= limit


def prefill_chunk(dec: Decoding, batch: int, limit: int, start: int):
  """(chunk, figures) of the largest chunk of the context, from `start` halving down to
  MIN_CHUNK, whose prefill at `batch` sequences fits; else (0, the smallest chunk's
  figures, None where it overflows)."""
  chunk, fig = start, None
  while chunk >= MIN_CHUNK:
    fig = _try(lambda c=chunk: dec.prefill(batch, c))
    if _fits(fig, limit):
      return chunk, fig
    chunk //= 2
  return 0, fig


def decoding(dec: Decoding, limit: int, hbm: int, report: dict, failed: list, log) -> None:
  """Decoding's figures into the report: `decode_step` at max_batch, the largest batch
  whose decode step fits and whose prompts prefill in chunks that fit too (prefill
  needs more than a decode step: a chunk's activations beside the whole cache), and
  `prefill` at one sequence and at max_batch."""
  out = report["programs"]
  report["spec"]["decode_attention"] = dec.model_spec.decode_attention
  per_seq = dec.cache_bytes_per_sequence()
  best, step = max_decode_batch(dec, limit, log)
  T = dec.model_spec.sequence_len
  one = prefill_chunk(dec, 1, limit, T)
  at_best = (0, None)
  for _ in range(4):  # fewer sequences until their prefill fits in some chunk
    if best == 0:
      break
    at_best = prefill_chunk(dec, best, limit, min(T, 4 * MIN_CHUNK))
    if at_best[0]:
      break
    over = at_best[1]  # the smallest chunk's peak, None where it overflowed HBM
    if over is None:
      best = best // 2 // dec.unit * dec.unit
    else:  # the peak falls about in proportion to the sequences
      fewer = -(-(over["peak_bytes"] - limit) * best // over["peak_bytes"])
      best = max(0, (best - max(dec.unit, fewer)) // dec.unit * dec.unit)
    log(f"  prefill does not fit beside the decode step's max_batch cache: trying {best}")
    step = _try(lambda b=best: dec.decode_step(b)) if best else None
  if best and not at_best[0]:
    best, step, at_best = 0, None, (0, None)
  out["decode_step"] = dict(step or {}, max_batch=best, cache_bytes_per_sequence=per_seq,
                            fits=best > 0)
  if best:
    log(memory_line(f"decode_step (max_batch {best}, {per_seq / 2**20:.1f} MiB of cache a "
                    "sequence)", step, hbm))
  else:
    log(f"decode_step: no batch of a multiple of {dec.unit} sequences decodes and prefills "
        f"within {limit / GiB:.2f} GiB ({per_seq / 2**20:.1f} MiB of cache a sequence)")
    failed.append("decode_step")
  out["prefill"] = {}
  for label, batch, (chunk, fig) in (("one_sequence", 1, one), ("max_batch", best, at_best)):
    if batch == 0:
      continue
    out["prefill"][label] = dict(fig or {"peak_bytes": None}, batch=batch, chunk=chunk,
                                 fits=chunk > 0)
    if not chunk:
      log(f"prefill ({batch} sequence(s)): does not fit in chunks of {MIN_CHUNK} tokens")
      failed.append(f"prefill at batch {batch}")
    else:
      log(memory_line(f"prefill ({batch} sequence(s), chunks of {chunk} tokens)", fig, hbm))


def overflow_message(report: dict) -> str:
  """One line: what does not fit, its peak against HBM, and the settings that lower it."""
  hbm = report["hbm_bytes_per_chip"]
  parts, training = [], False
  for name in report["failed"]:
    fig = report["programs"].get(name, {})
    peak = fig.get("peak_bytes")
    parts.append(f"{name} ({'over HBM' if peak is None else f'peak {peak / GiB:.2f} GiB'})")
    training = training or name in ("train_step", "eval_step", "update_step")
  return (f"does not fit {report['topology']} ({FIT:.0%} of {hbm / GiB:.2f} GiB HBM per chip): "
          + "; ".join(parts) + f"; lower it with {LOWER_TRAIN if training else LOWER_DECODE}")
