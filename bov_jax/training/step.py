"""The training state and the pure steps: parameters and optimizer state created
sharded, the train step (gradients averaged over micro-batches in a `lax.scan`), the
eval step. `build` puts them together once for a run; the loop (train.py), the
compiler (aot.py) and the benchmarks call it and nothing below it.

Parameters and optimizer state are plain pytrees (the model's `nnx.split` state as a
pure dict), so one `jax.jit` compiles the whole step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from bov_jax.model import params as params_lib
from bov_jax.optim import optimizer as optim
from bov_jax.parallel import sharding
from bov_jax.parallel import state_layout
from bov_jax.run.plan import BatchLayout
from bov_jax.run.spec import RunSpec

REPLICAS = ("slice", "data")  # the mesh axes whose devices hold whole copies of the model


def make_train_step(graphdef, tx, update_specs=None):
  """step(params, opt_state, inputs [A, B, T], targets [A, B, T]) -> new state, metrics.

  Gradients are averaged over the A micro-batches with a lax.scan, so one compiled
  step reaches train.batch_tokens whatever fits in memory. Over data replicas
  (mesh.data > 1 or several slices, the mesh set when the step is traced) each replica
  accumulates its own rows' gradients and the replicas' sums are reduced once, after the
  loop (MaxText's utils/gradient_accumulation.py): inside each slice into the shares of
  `update_specs` (a PartitionSpec per parameter, `state_layout.update_specs`), then each
  share summed across slices (reduce-scattered, where `update_specs` splits it across
  slices too), so only a chip's own share crosses the network between slices; the
  optimizer then updates each replica's share and the new parameters are gathered
  (optim.muon: what each slice owns). Without `update_specs`, all-reduced whole.
  """

  def loss_fn(params, x, y, weight=None):
    loss = nnx.merge(graphdef, params).loss(x, y)
    return loss if weight is None else weight * loss

  def accumulate(params, inputs, targets, totals=None):
    """(mean loss, mean gradients) over the micro-batches; `totals` [A]: each
    micro-batch's targets over all replicas, whose share of them scales a replica's
    loss (counted before the loop, so nothing inside it waits on another replica)."""
    grad_fn = jax.value_and_grad(loss_fn)
    weights = (None if totals is None else
               jnp.sum(targets >= 0, axis=(1, 2)) / jnp.maximum(totals, 1))

    def micro(acc, xyw):
      loss, grads = grad_fn(params, *xyw)
      return jax.tree.map(jnp.add, acc, (loss, grads)), None

    n = inputs.shape[0]
    if n == 1:  # no accumulation loop to pay for
      return grad_fn(params, inputs[0], targets[0], None if weights is None else weights[0]), n
    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    if weights is None:
      return jax.lax.scan(lambda acc, xy: micro(acc, (*xy, None)), zeros, (inputs, targets))[0], n
    return jax.lax.scan(micro, zeros, (inputs, targets, weights))[0], n

  def data_parallel(params, inputs, targets, mesh):
    """accumulate() inside a shard_map over the replicas (`slice` x `data`): each
    replica's gradients stay its own through the loop, then one reduce-scatter (or
    all-reduce) over the slice's replicas and one all-reduce (or reduce-scatter) of that
    share over slices."""
    specs = (jax.tree.map(lambda _: P(), params) if update_specs is None else update_specs)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    dims = jax.tree.map(state_layout.data_dim, specs, is_leaf=is_spec)
    # the replica axes each share is split over (a dimension's `data` x `slice` part)
    reps = jax.tree.map(lambda s, d: () if d < 0 else tuple(
        a for a in sharding.axes_of(s[d]) if a in REPLICAS), specs, dims, is_leaf=is_spec)

    def reduce(g, dim, axes):
      g = (jax.lax.psum(g, "data") if dim < 0 else
           jax.lax.psum_scatter(g, "data", scatter_dimension=dim, tiled=True))
      if "slice" in axes:  # across slices too: this chip's share of its slice's share
        return jax.lax.psum_scatter(g, "slice", scatter_dimension=dim, tiled=True)
      return jax.lax.psum(g, "slice")  # across slices: this chip's share only

    def local(params, inputs, targets):
      # a micro-batch's loss counts by its share of every replica's targets
      totals = jax.lax.psum(jnp.sum(targets >= 0, axis=(1, 2)), REPLICAS)
      (loss, grads), n = accumulate(params, inputs, targets, totals)
      return jax.lax.psum(loss, REPLICAS) / n, jax.tree.map(
          lambda g, d, a: reduce(g, d, a) / n, grads, dims, reps,
          is_leaf=lambda x: isinstance(x, tuple))

    out_specs = jax.tree.map(lambda d, a: P() if d < 0 else P(*([None] * d), a),
                             dims, reps, is_leaf=lambda x: isinstance(x, tuple))
    rows = P(None, REPLICAS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), rows, rows),
                         out_specs=(P(), out_specs), axis_names=set(REPLICAS),
                         check_vma=False)(params, inputs, targets)

  update = make_update(tx)

  def step(params, opt_state, inputs, targets):
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape["data"] * mesh.shape["slice"] > 1:
      loss, grads = data_parallel(params, inputs, targets, mesh)
    else:
      (loss, grads), n = accumulate(params, inputs, targets)
      if n > 1:
        loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
    params, opt_state = update(grads, opt_state, params)
    return params, opt_state, {"train_loss": loss}

  return step


def make_update(tx):
  """update(mean gradients, opt_state, params) -> (params, opt_state): the optimizer's
  part of the train step."""

  def update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return update


def make_eval_step(graphdef):
  """(params, inputs, targets, token_bytes) -> (nats over byte-bearing targets, bytes)."""

  def eval_step(params, inputs, targets, token_bytes):
    nll = nnx.merge(graphdef, params).token_losses(inputs, targets)
    nb = token_bytes[jnp.maximum(targets, 0)] * (targets >= 0)
    return jnp.sum(jnp.where(nb > 0, nll, 0.0)), jnp.sum(nb).astype(jnp.float32)

  return eval_step


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
  grad_shardings: object  # where the train step's mean gradients reach the optimizer
  layout: BatchLayout
  train_step: object  # jitted (params, opt_state, inputs, targets); donates the state
  eval_step: object   # jitted (params, inputs, targets, token_bytes)
  update_step: object  # jitted (grads, opt_state, params): the train step's optimizer part


def build(spec: RunSpec, mesh, num_iterations: int, key=None, init: bool = True) -> TrainSetup:
  """Parameters and optimizer state on the mesh, and the jitted train and eval steps.
  With init=False (a resume: a checkpoint will replace them) the state is abstract,
  shapes and shardings only, so nothing is compiled, run or allocated twice."""
  if mesh.size != spec.n_devices:
    raise ValueError(f"the run spec is resolved for {spec.n_devices} devices, the mesh has "
                     f"{mesh.size}: resolve it with n_devices={mesh.size}")
  key = jax.random.key(spec.train.seed) if key is None else key
  graphdef, params, param_shardings = (params_lib.init_params(spec.model, mesh, key) if init
                                       else params_lib.abstract_params(spec.model, mesh))
  param_specs = sharding.param_specs_of(param_shardings)
  update_layout = (state_layout.UpdateLayout(param_specs,
                                             state_layout.update_specs(param_specs, params, mesh,
                                                                       optim.splits_across_slices))
                   if spec.optim.shard_optimizer and mesh.size > 1 else None)
  update_specs = None if update_layout is None else update_layout.update_specs
  tx = optim.make(spec.optim, num_iterations, layout=update_layout)
  with jax.set_mesh(mesh):
    abstract, specs = state_layout.optimizer_specs(
        tx, params, param_specs if update_layout is None else update_specs)
    opt_shardings = sharding.named(mesh, specs)
    opt_state = (jax.jit(tx.init, out_shardings=opt_shardings)(params) if init else
                 jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract, opt_shardings))
  batch_shardings = sharding.batch_sharding(mesh, leading_dims=2)
  train_step = jax.jit(make_train_step(graphdef, tx, update_specs),
                       in_shardings=(param_shardings, opt_shardings, batch_shardings,
                                     batch_shardings),
                       out_shardings=(param_shardings, opt_shardings, None), donate_argnums=(0, 1))
  grad_shardings = param_shardings if update_specs is None else sharding.named(mesh, update_specs)
  update_step = jax.jit(make_update(tx),
                        in_shardings=(grad_shardings, opt_shardings, param_shardings),
                        out_shardings=(param_shardings, opt_shardings))
  return TrainSetup(graphdef=graphdef, tx=tx, params=params, opt_state=opt_state,
                    param_shardings=param_shardings, opt_shardings=opt_shardings,
                    grad_shardings=grad_shardings,
                    layout=spec.batch, train_step=train_step,
                    eval_step=jax.jit(make_eval_step(graphdef)), update_step=update_step)
