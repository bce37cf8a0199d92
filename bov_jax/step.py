"""The training state and the pure steps: parameters and optimizer state created
sharded, the train step (gradients averaged over micro-batches in a `lax.scan`), the
eval step. `build` puts them together once for a run; the loop (train.py), the
modes (modes.py) and the benchmarks call it and nothing below it.

Parameters and optimizer state are plain pytrees (the model's `nnx.split` state as a
pure dict), so one `jax.jit` compiles the whole step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bov_jax import config as config_lib
from bov_jax import model as model_lib
from bov_jax import optim
from bov_jax import plan
from bov_jax import sharding
from bov_jax.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How one optimizer step's train.batch_tokens are laid out."""
  rows_per_device: int  # per micro-batch
  accum: int            # micro-batches per step
  local_rows: int       # rows per micro-batch that this process loads


def batch_layout(spec: RunSpec, n_devices: int | None = None,
                 n_local: int | None = None) -> BatchLayout:
  """Rows per device per micro-batch: train.device_batch_size, or fewer when one step's
  batch is smaller than that many rows on every device; then as many micro-batches as
  reach train.batch_tokens."""
  n_dev = jax.device_count() if n_devices is None else n_devices
  n_local = jax.local_device_count() if n_local is None else n_local
  T, tokens = spec.model.sequence_len, spec.train.batch_tokens
  rows_total = tokens // T
  if tokens % T or rows_total % n_dev:
    raise config_lib.ConfigError(
        f"train.batch_tokens={tokens} must be a multiple of "
        f"model.sequence_len x devices = {T} x {n_dev} = {T * n_dev}")
  per_device = min(spec.train.device_batch_size, rows_total // n_dev)
  if (rows_total // n_dev) % per_device:
    raise config_lib.ConfigError(
        f"train.batch_tokens={tokens} must be a multiple of "
        f"train.device_batch_size x devices x model.sequence_len = "
        f"{per_device} x {n_dev} x {T} = {per_device * n_dev * T}")
  return BatchLayout(rows_per_device=per_device, accum=rows_total // (per_device * n_dev),
                     local_rows=per_device * n_local)


def make_train_step(graphdef, tx):
  """step(params, opt_state, inputs [A, B, T], targets [A, B, T]) -> new state, metrics.

  Gradients are averaged over the A micro-batches with a lax.scan, so one compiled
  step reaches train.batch_tokens whatever fits in memory.
  """

  def loss_fn(params, x, y):
    return nnx.merge(graphdef, params).loss(x, y)

  def step(params, opt_state, inputs, targets):
    grad_fn = jax.value_and_grad(loss_fn)

    def micro(acc, xy):
      loss, grads = grad_fn(params, *xy)
      return jax.tree.map(jnp.add, acc, (loss, grads)), None

    n = inputs.shape[0]
    if n == 1:  # no accumulation loop to pay for
      loss, grads = grad_fn(params, inputs[0], targets[0])
    else:
      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
      (loss, grads), _ = jax.lax.scan(micro, zeros, (inputs, targets))
      loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"train_loss": loss}

  return step


def make_eval_step(graphdef):
  """(params, inputs, targets, token_bytes) -> (nats over byte-bearing targets, bytes)."""

  def eval_step(params, inputs, targets, token_bytes):
    nll = nnx.merge(graphdef, params).token_losses(inputs, targets)
    nb = token_bytes[jnp.maximum(targets, 0)] * (targets >= 0)
    return jnp.sum(jnp.where(nb > 0, nll, 0.0)), jnp.sum(nb).astype(jnp.float32)

  return eval_step


def abstract_params(spec: RunSpec, mesh):
  """(graphdef, parameters as ShapeDtypeStructs with their shardings, shardings)."""
  graphdef, abstract = nnx.split(model_lib.abstract(spec.model))
  shardings = sharding.named(mesh, sharding.param_specs(abstract, mesh))
  params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                        nnx.to_pure_dict(abstract), shardings)
  return graphdef, params, shardings


def init_params(spec: RunSpec, mesh, key):
  """(graphdef, params, shardings): parameters created already sharded, inside one jit."""
  graphdef, _, shardings = abstract_params(spec, mesh)
  with jax.set_mesh(mesh):
    model = model_lib.init(spec.model, key, shardings)
  return graphdef, nnx.to_pure_dict(nnx.state(model)), shardings


@dataclasses.dataclass
class TrainSetup:
  """A run's jitted steps and its initial state (or its abstract shape, for a resume),
  built once (`build`); the loop that runs them is train.py's."""
  graphdef: object
  tx: object
  params: object
  opt_state: object
  param_shardings: object
  opt_shardings: object
  layout: BatchLayout
  train_step: object  # jitted (params, opt_state, inputs, targets); donates the state
  eval_step: object   # jitted (params, inputs, targets, token_bytes)


def build(spec: RunSpec, mesh, num_iterations: int, key=None, init: bool = True) -> TrainSetup:
  """Parameters and optimizer state on the mesh, and the jitted train and eval steps.
  With init=False (a resume: a checkpoint will replace them) the state is abstract,
  shapes and shardings only, so nothing is compiled, run or allocated twice."""
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  layout = batch_layout(spec, mesh.size, local)
  key = jax.random.key(spec.train.seed) if key is None else key
  graphdef, params, p_sh = (init_params(spec, mesh, key) if init
                            else abstract_params(spec, mesh))
  tx = optim.make(spec.optim, num_iterations, plan.hyperparams(spec))
  with jax.set_mesh(mesh):
    abstract, specs = sharding.optimizer_specs(tx, params, sharding.param_specs_of(p_sh))
    o_sh = sharding.named(mesh, specs)
    opt_state = (jax.jit(tx.init, out_shardings=o_sh)(params) if init else
                 jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract, o_sh))
  batch_sh = sharding.batch_sharding(mesh, leading_dims=2)
  train_step = jax.jit(make_train_step(graphdef, tx),
                       in_shardings=(p_sh, o_sh, batch_sh, batch_sh),
                       out_shardings=(p_sh, o_sh, None), donate_argnums=(0, 1))
  return TrainSetup(graphdef=graphdef, tx=tx, params=params, opt_state=opt_state,
                 param_shardings=p_sh, opt_shardings=o_sh, layout=layout,
                 train_step=train_step, eval_step=jax.jit(make_eval_step(graphdef)))
