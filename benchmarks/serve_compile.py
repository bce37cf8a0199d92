"""The serving engine's decode step compiled for one TPU chip at the cache budget the chip
holds: pages, positions and full-context sequences per chip, BoV against the baseline.

  python -m benchmarks.serve_compile --config=configs/bov_135m.py \
      --baseline=configs/baseline_135m.py [--topology=v5e-8] [--page_size=16] [--json]

One engine per chip: the model whole on each chip and requests spread over the chips
(data-parallel serving, as vLLM and JetStream serve a model of this size). A chip's budget
is the most pages (whole sequences of the model's context) whose decode step, in its
largest bucket (every slot, every page), peaks at <= 90% of the chip's HBM, with as many
slots as full-context sequences fit in those pages. Nothing is allocated: the programs are
lowered on the slice's compile-only devices (libtpu, `pip install '.[tpu]'`).
"""

from __future__ import annotations

import jax
from absl import app
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

from benchmarks import common
from bov_jax.model import gpt as model_lib
from bov_jax.model import kvcache
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.parallel import topology as topology_lib
from bov_jax.run import spec as spec_lib
from bov_jax.serving import programs as programs_lib
from bov_jax.training import aot

_BASELINE = config_flags.DEFINE_config_file("baseline", None, "The baseline's config file.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e-8", "The TPU slice (gcloud's name).")
_PAGE = flags.DEFINE_integer("page_size", 16, "The engine's page size.")


class ChipEngine:
  """One config's engine programs on one compile-only chip, for any number of pages."""

  def __init__(self, cfg, device, page_size: int):
    self.spec = spec_lib.resolve(cfg, backend="tpu", n_devices=1, device=device)
    self.mesh = sharding.make_mesh(self.spec.mesh, [device])
    self.graphdef, self.params, _ = params_lib.abstract_params(self.spec.model, self.mesh)
    self.model = model_lib.abstract(self.spec.model)
    self.page_size = page_size
    self.max_pages = -(-self.spec.model.sequence_len // page_size)
    self.page_bytes = kvcache.page_bytes(self.model, page_size)
    self.param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))

  def figures(self, num_pages: int) -> dict | None:
    """The decode step's memory with `num_pages` pages (None where it overflows HBM)."""
    slots = max(1, num_pages // self.max_pages)
    init = lambda: kvcache.init_paged(self.model, slots, num_pages, self.page_size,  # noqa: E731
                                      self.max_pages)
    here = NamedSharding(self.mesh, P())
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here),
                         jax.eval_shape(init))
    programs = programs_lib.Programs(self.graphdef, self.params, slots, num_pages,
                                     self.page_size, self.max_pages, cache=cache)
    with jax.set_mesh(self.mesh):
      lowered = programs.lower_decode(rows=slots, span=self.max_pages)
    try:
      fig = aot.compile_lowered(lowered)[0]
    except aot.Overflow:
      return None
    return dict(fig, pages=num_pages, slots=slots)


def budget(engine: ChipEngine, limit: int, log=print) -> dict:
  """The most pages (a whole number of full-context sequences) whose decode step fits:
  two compiles aim at the limit along the step's linear growth, a few more confirm it."""
  unit = engine.max_pages
  first = engine.figures(unit)
  if first is None or first["peak_bytes"] > limit:
    raise ValueError(f"one sequence's decode step does not fit a chip "
                     f"({first and first['peak_bytes']} bytes > {limit})")
  lo, hi, best = unit, None, first
  guess = 64 * unit
  for _ in range(12):
    if hi is not None and hi - lo <= unit:
      break
    guess = max(lo + unit, guess if hi is None else min(guess, hi - unit)) // unit * unit
    fig = engine.figures(guess)
    log(f"  {guess} pages: " + ("overflows HBM" if fig is None else
                                f"peak {fig['peak_bytes'] / topology_lib.GiB:.2f} GiB"))
    if fig is not None and fig["peak_bytes"] <= limit:
      slope = (fig["peak_bytes"] - best["peak_bytes"]) / (guess - lo)
      lo, best = guess, fig
      guess = lo + max(unit, int((limit - fig["peak_bytes"]) / slope) if slope > 0 else lo)
    else:
      hi = guess
      guess = (lo + hi) // 2
  return best


def main(argv) -> None:
  del argv
  if common.CONFIG.value is None or _BASELINE.value is None:
    raise ValueError("--config=FILE and --baseline=FILE are required "
                     "(for example configs/bov_135m.py and configs/baseline_135m.py)")
  jax.config.update("jax_enable_compilation_cache", False)  # compile_s is a real compile
  devices, chip = topology_lib.devices(_TOPOLOGY.value)
  limit = int(aot.FIT * chip.hbm_bytes)
  rows = {}
  for name, cfg in (("bov", common.CONFIG.value), ("baseline", _BASELINE.value)):
    engine = ChipEngine(cfg, devices[0], _PAGE.value)
    fig = budget(engine, limit, log=(lambda _: None) if common.JSON.value else print)
    positions = fig["pages"] * engine.page_size
    rows[name] = row = {
        "system": name, "topology": _TOPOLOGY.value, "chips": len(devices),
        "preset": engine.spec.model.value.preset, "page_size": engine.page_size,
        "cache_bytes_per_position": engine.page_bytes / engine.page_size,
        "param_gib": round(engine.param_bytes / topology_lib.GiB, 3),
        "pages_per_chip": fig["pages"], "positions_per_chip": positions,
        "sequences_per_chip": fig["slots"], "sequences_per_slice": fig["slots"] * len(devices),
        "peak_gib": round(fig["peak_bytes"] / topology_lib.GiB, 3),
        "temp_gib": round(fig["temp_bytes"] / topology_lib.GiB, 3),
        "hbm_gib": round(chip.hbm_bytes / topology_lib.GiB, 2),
        "context": engine.spec.model.sequence_len, "compile_s": fig["compile_s"]}
    common.emit(row)
  bov, base = rows["bov"], rows["baseline"]
  common.emit({"sequences_ratio": round(bov["sequences_per_chip"] / base["sequences_per_chip"], 3),
               "positions_ratio": round(bov["positions_per_chip"] / base["positions_per_chip"], 3),
               "bytes_per_position_ratio": round(base["cache_bytes_per_position"]
                                                 / bov["cache_bytes_per_position"], 3)})


if __name__ == "__main__":
  app.run(main)
