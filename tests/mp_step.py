"""Run by tests/test_multiprocess.py in each process of a run (or alone): one train step of
a small BoV model on a fixed global batch over four devices (data 2 x fsdp 2), and the
training groups this process would read. Prints one JSON line.

  python -m tests.mp_step N_PROCESSES PROCESS_ID PORT
"""
import json
import sys


def main(n: int, pid: int, port: int) -> None:
  import jax
  if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=n, process_id=pid)
  import jax.numpy as jnp
  import numpy as np

  from bov_jax.data import batches as data
  from bov_jax.data import corpus
  from bov_jax.parallel import sharding
  from bov_jax.run import spec as spec_lib
  from bov_jax.training import step
  from tests.helpers import small_config
  cfg = small_config("gpt_base_v_from_value_emb_learn", vocab_size=120, n_layer=2)
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 2, 2, 1
  cfg.train.batch_tokens, cfg.train.device_batch_size = 2 * 8 * 64, 2  # two micro-batches
  spec = spec_lib.resolve(cfg)
  mesh = sharding.make_mesh(spec.mesh)
  tr = step.build(spec, mesh, num_iterations=10)
  L = tr.layout
  tokens = np.random.default_rng(0).integers(0, 120, (L.accum, 8, 65)).astype(np.int32)
  bsh = sharding.batch_sharding(mesh, leading_dims=2)
  x, y = (jax.make_array_from_callback((L.accum, 8, 64), bsh, lambda i, a=a: a[i])
          for a in (tokens[..., :-1], tokens[..., 1:]))
  with jax.set_mesh(mesh):
    params, _, out = tr.train_step(tr.params, tr.opt_state, x, y)
    sums = jax.jit(lambda ps: jax.tree.map(lambda p: (jnp.sum(p.astype(jnp.float32) ** 2),
                                                      jnp.sum(p.astype(jnp.float32))), ps))(
        params)  # one program for every parameter
  leaves = jax.tree_util.tree_leaves_with_path(sums)
  train, _ = corpus.split(corpus.from_documents([f"d{i}" for i in range(20_000)]), "every_nth",
                         20, 0)
  w = data.TrainWindows(train, None, seed=0, process_index=jax.process_index(),
                        process_count=jax.process_count())
  groups = [int(g) for k in range(w.per_epoch) for g in w.groups(k)]
  print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                    "devices": jax.device_count(), "loss": float(out["train_loss"]),
                    "params": {jax.tree_util.keystr(k): float(v) for k, v in leaves},
                    "groups": groups, "all_groups": len(train.groups)}), flush=True)


if __name__ == "__main__":
  main(*map(int, sys.argv[1:4]))
