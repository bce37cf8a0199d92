"""Run by tests/test_multiprocess.py in each process (or alone): tests/test_step.py's five
steps of two micro-batches, on two processes of two CPU devices standing for two slices
(`mesh.slices=2`: each process a slice), for each layout inside a slice; alone, on one
device. Process 0 writes each layout's losses and parameters to OUT/LAYOUT.npz.

  python -m tests.mp_slices N_PROCESSES PROCESS_ID PORT OUT
"""
import sys

LAYOUTS = [(4, 1, 1, 2), (2, 2, 1, 2)]  # (data, fsdp, tensor, slices): data, FSDP in a slice


def main(n: int, pid: int, port: int, out: str) -> None:
  import jax
  if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=n, process_id=pid)
  import numpy as np
  from jax.experimental import multihost_utils

  from tests import test_step as ts
  for shape in LAYOUTS if n > 1 else [(1, 1, 1)]:
    mesh, tr = ts._setup(shape)
    if n > 1:  # each slice is one process's devices
      assert [{d.process_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
    losses, params, _ = ts._train(mesh, tr, *ts._start(tr), ts.STEPS)
    whole = multihost_utils.process_allgather(params, tiled=True)
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(whole)}
    if pid == 0:
      np.savez(f"{out}/{'x'.join(map(str, shape))}.npz", losses=np.asarray(losses), **flat)


if __name__ == "__main__":
  main(*map(int, sys.argv[1:4]), sys.argv[4])
