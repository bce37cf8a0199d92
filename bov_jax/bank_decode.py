"""One decode step's attention in a bank layer, with the table gather fused in (Pallas).

A bank layer caches no values: its value at cached position s is gamma * E[ids[s]]
(SPEC section 7). Written in XLA (`inference._cached_values`), every decode step
gathers the rows of all cached positions into a [B * K, S, E] buffer in HBM and
attention reads that buffer back: the rows cross HBM three times, where a layer
with a stored value cache reads them once. These kernels read each row once,
straight from the table, so a bank layer decodes at the memory traffic of a
stored-value layer with a cache that holds only ids.

  tpu  (Mosaic) grid (core, row, 128-position block); one DMA per cached position
       from its table row into VMEM, a block ahead of its use (double buffer),
       and across rows: a core runs its rows in order, and a row's last block
       requests the next row's first, so only a core's first block waits.
  gpu  (Triton) grid (row, 16 splits of the cache), each split looping over
       64-position blocks whose value rows it loads by pointer (a gather load);
       the splits' partial softmaxes are joined after (flash decoding).

`model.decode_attention` picks: `auto` is the TPU kernel on TPU when it fits
(`fits`) and has compiled there for the layer's shapes (`compiles`: Mosaic's own
compile has never run in this project, so a rejection falls back to XLA with a
warning instead of failing the run), and XLA's gather elsewhere; `fused` asks for
the backend's kernel (off TPU and GPU, the TPU kernel in the Pallas interpreter:
slow, for tests); `xla` keeps the gather-then-attend path. Neither kernel's speed is measured
(docs/performance.md): no TPU here, and no GPU was lent since they were written.
`scripts/gpu_bench.sh decode_test decode_xla decode_fused` measures the GPU one.

Layout (as `attention.attend` takes it): rows n = b * K + h, one per sequence b
and kv head h; G query heads per kv head. A key block outside the query's window
is neither fetched nor computed. With a vocab-split table (under a mesh) each
shard gathers only its own rows, the others count as zero, and the partial
outputs (normalised by the full softmax, which every shard computes alike from
the same keys) are summed with `psum`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from bov_jax import sharding

IMPLS = ("auto", "xla", "fused")
BLOCK = 128  # TPU: cached positions per grid step: one 128-row key tile, 128 row DMAs
CORES = 2  # TPU: megacore chips split the rows over two TensorCores
LANES = 128  # TPU: running max and sum are kept lane-replicated, as TPU flash kernels do
GPU_BLOCK = 64  # GPU: cached positions per loop step
GPU_SPLITS = 16  # GPU: programs per (sequence, kv head), each over a 16th of the cache,
                 # so a batch of one still fills the SMs (flash decoding's split-K)
GPU_ROWS = 16  # GPU: query heads padded to 16 rows (Triton's smallest dot) or more
MASKED = -0.7 * float(np.finfo(np.float32).max)  # finite: no inf - inf in the GPU kernel


def fits(context: int, head_dim: int, backend: str = "tpu") -> bool:
  """What the backend's kernel takes. TPU: whole 128-position blocks and
  lane-wide head dims. GPU (Triton): whole 64-position blocks and power-of-two
  head dims of at least 16 (Triton's tensor shapes and dot sizes)."""
  if backend == "gpu":
    return context % GPU_BLOCK == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0
  return context % BLOCK == 0 and head_dim % 128 == 0


def resolve(impl: str, context: int, head_dim: int, table_lookup: str, batch: int = 1,
            table_rows: int = 0, *, n_kv_head: int = 1, group: int = 1,
            window: int | None = None, dtype=jnp.float32, table_dtype=jnp.float32) -> str:
  """`fused` or `xla` for this cache. `auto` is `fused` on TPU only, and only once
  the kernel has compiled there for this layer (`compiles`): the GPU kernel is
  there to be measured (scripts/gpu_bench.sh) before it becomes the default. A
  cache the backend's kernel does not fit, tables kept in host memory
  (`sample.tables_on_host`), and a mesh that splits the batch and the table over
  a shared axis (`mesh_split`) take `xla`. The keyword arguments describe the
  layer for `compiles`: kv heads, query heads per kv head, window (None: the
  whole cache), compute and table dtypes."""
  backend = "gpu" if jax.default_backend() == "gpu" else "tpu"
  split = mesh_split(batch, table_rows)
  if table_lookup == "host" or not fits(context, head_dim, backend) or split is None:
    return "xla"
  if impl != "auto":
    return impl
  if jax.default_backend() != "tpu":
    return "xla"
  vocab = split[1]
  local_rows = (table_rows or BLOCK) // math.prod(
      jax.sharding.get_abstract_mesh().shape[a] for a in vocab)
  window = context if window is None else min(window, context)
  ok = compiles(n_kv_head, group, head_dim, context, window, jnp.dtype(dtype).name, local_rows,
                jnp.dtype(table_dtype).name, bool(vocab))
  return "fused" if ok else "xla"


@functools.lru_cache(maxsize=None)
def compiles(n_kv_head: int, group: int, head_dim: int, context: int, window: int, dtype: str,
             table_rows: int, table_dtype: str, split: bool) -> bool:
  """Whether the TPU kernel compiles on this backend for one sequence of this
  layer's shapes. `auto` asks this once per shape before it picks the kernel:
  Mosaic's own compile (in libtpu) has never run in this project, which has had
  no TPU at hand (docs/performance.md), so a kernel it rejects must not take a
  TPU run's decoding down with it. A failure leaves XLA's gather, with a
  warning naming the setting; `model.decode_attention=fused` skips the check
  (and fails loudly)."""
  K, E = n_kv_head, head_dim
  args = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((K, group, E), dtype), ((K, context, E), dtype), ((1, context), jnp.int32),
      ((table_rows, K * E), table_dtype), ((1,), jnp.int32), ((1,), jnp.int32))]
  call = functools.partial(_call_tpu, window=window, split=split, interpret=False)
  try:
    # One device, as the kernel runs (per shard, under `shard_map`, on a mesh).
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      jax.jit(call).lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except  (any compile failure means: not here)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    logging.warning("model.decode_attention=auto: the fused bank-layer decode kernel did "
                    "not compile on %s for head_dim=%d, %d query heads per kv head, "
                    "context=%d (%s); decoding gathers with XLA instead. "
                    "model.decode_attention=xla skips this check.",
                    jax.default_backend(), E, group, context, first)
    return False
  return True


def mesh_split(batch: int, table_rows: int):
  """(batch axes, vocab axes) the kernel runs split over under the current mesh,
  or None when the batch and the table's vocabulary share a split axis (fsdp):
  a sequence's rows then sit on other devices, and XLA's lookup, which moves the
  rows rather than the caches, is the cheaper path. The batch is split as
  `sharding.table_lookup` splits it (not at all when it does not divide)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return (), ()
  vocab = sharding.table_axes(mesh, table_rows) if table_rows else ()
  batch_axes = tuple(a for a in sharding.BATCH_AXES if mesh.shape[a] > 1)
  if batch % math.prod(mesh.shape[a] for a in batch_axes):
    batch_axes = ()
  if set(batch_axes) & set(vocab):
    return None
  return batch_axes, vocab


def _tpu_kernel(qpos_ref, vstart_ref, ids_ref, ids_next_ref, q_ref, k_ref, table_ref, o_ref,
                vbuf, sems, m_ref, l_ref, acc_ref, count_ref, *, K, R, window, local_rows,
                split):
  """One (core, row, key block) grid step: the block's rows gathered by DMA, a block
  ahead, across rows too (a core runs its R rows in order)."""
  r, j = pl.program_id(1), pl.program_id(2)
  n = pl.program_id(0) * R + r
  b, h = _div(n, K), jax.lax.rem(n, np.int32(K))
  qpos = qpos_ref[b]
  lo, hi = _block_range(qpos, window)

  @pl.when((r == 0) & (j == 0))
  def _start():
    count_ref[0] = 0  # blocks this core has computed: their parity picks the vbuf half

  slot = jax.lax.rem(count_ref[0], np.int32(2))  # vbuf half holding block j's rows

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def row_of(ids, i, head):
    tok = ids[0, i] - vstart_ref[0]
    mine = (tok >= 0) & (tok < local_rows)
    return jnp.where(mine, tok, 0) * K + head, mine

  def copy(ids, i, half, head=h):
    return pltpu.make_async_copy(table_ref.at[pl.ds(row_of(ids, i, head)[0], 1)],
                                 vbuf.at[half, pl.ds(i, 1)], sems.at[half])

  def request(ids, half, head=h):
    jax.lax.fori_loop(0, BLOCK, lambda i, c: (copy(ids, i, half, head).start(), c)[1], 0)

  # Rows are requested a block ahead: block j + 1's DMAs run while block j is
  # computed, and a row's last block requests the next row's first, so only a
  # core's first block waits on its gather.
  @pl.when((j == lo) & (r == 0))
  def _first():
    request(ids_ref, slot)

  @pl.when((j >= lo) & (j < hi))
  def _ahead():
    request(ids_next_ref, 1 - slot)

  @pl.when((j == hi) & (r + 1 < R))
  def _next_row():
    request(ids_next_ref, 1 - slot, jax.lax.rem(n + 1, np.int32(K)))

  @pl.when((j >= lo) & (j <= hi))
  def _block():
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    delta = qpos - (j * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1))
    s = jnp.where((delta >= 0) & (delta <= window), s, -jnp.inf)
    m_prev = m_ref[...][:, :1]
    # The first block processed always holds a visible key (the window's first
    # position or the query's own), so m is finite from then on.
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_next)
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = jnp.broadcast_to(alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True),
                                  l_ref.shape)
    m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
    jax.lax.fori_loop(0, BLOCK, lambda i, c: (copy(ids_ref, i, slot).wait(), c)[1], 0)
    rows = vbuf.at[slot]
    if split:  # rows another shard holds count as zero here; the psum adds them
      def clear(i, c):
        @pl.when(jnp.logical_not(row_of(ids_ref, i, h)[1]))
        def _():
          rows[pl.ds(i, 1), :] = jnp.zeros((1, rows.shape[1]), rows.dtype)
        return c
      jax.lax.fori_loop(0, BLOCK, clear, 0)
    v = rows[...].astype(jnp.float32)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)
    count_ref[0] += 1

  @pl.when(j == pl.num_programs(2) - 1)
  def _out():
    o_ref[...] = (acc_ref[...] / l_ref[...][:, :1]).astype(o_ref.dtype)


def _block_range(qpos, window):
  """First and last key block a query at qpos sees (keys qpos - window .. qpos)."""
  return _div(jnp.maximum(qpos - window, 0), BLOCK), _div(qpos, BLOCK)


def _div(a, d: int):
  """a // d for a >= 0. Truncating division: `//` on signed integers lowers
  through `sign`, which Mosaic lowers per TPU generation, so a lowering check
  off TPU could not run it."""
  return jax.lax.div(a, np.int32(d))


def _call_tpu(q_NGE, k_NSE, ids_BS, table_VF, qpos_B, vstart, *, window, split, interpret):
  N, G, E = q_NGE.shape
  B, S = ids_BS.shape
  K = N // B
  V = table_VF.shape[0]
  table_RE = table_VF.reshape(V * K, E)  # row id * K + h: one kv head's value of token id
  nb = S // BLOCK
  # The ids of one block as the whole of a [1, 128] array: TPU blocks must fill
  # (8, 128) tiles or whole dimensions, and SMEM holds only this block.
  ids_R1C = ids_BS.astype(jnp.int32).reshape(B * nb, 1, BLOCK)

  # Rows split over CORES: Mosaic gives a megacore chip's two TensorCores one half
  # each of a "parallel" dimension, and each core runs its rows in order
  # ("arbitrary"), which the cross-row request needs.
  C = CORES if N % CORES == 0 else 1
  R = N // C

  def key_block(n, j, qpos):
    lo, hi = _block_range(qpos[_div(n, K)], window)
    return jnp.clip(j, lo, hi)

  def ids_block(c, r, j, qp, vs):
    n = c * R + r
    return (_div(n, K) * nb + key_block(n, j, qp), 0, 0)

  def ids_next_block(c, r, j, qp, vs):
    """Block j + 1 of this row, or from the row's last block on, the next row's
    first (the rows requested ahead)."""
    n = c * R + r
    nxt = jnp.minimum(n + 1, N - 1)
    last = j >= _block_range(qp[_div(n, K)], window)[1]
    return (jnp.where(last, _div(nxt, K) * nb + _block_range(qp[_div(nxt, K)], window)[0],
                      _div(n, K) * nb + key_block(n, j + 1, qp)), 0, 0)

  kernel = functools.partial(_tpu_kernel, K=K, R=R, window=window, local_rows=V, split=split)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(C, R, nb),
          in_specs=[
              pl.BlockSpec((None, 1, BLOCK), ids_block, memory_space=pltpu.SMEM),
              pl.BlockSpec((None, 1, BLOCK), ids_next_block, memory_space=pltpu.SMEM),
              pl.BlockSpec((None, G, E), lambda c, r, j, qp, vs: (c * R + r, 0, 0)),
              pl.BlockSpec((None, BLOCK, E),
                           lambda c, r, j, qp, vs: (c * R + r, key_block(c * R + r, j, qp), 0)),
              pl.BlockSpec(memory_space=pl.ANY),
          ],
          out_specs=pl.BlockSpec((None, G, E), lambda c, r, j, qp, vs: (c * R + r, 0, 0)),
          scratch_shapes=[
              pltpu.VMEM((2, BLOCK, E), table_VF.dtype),
              pltpu.SemaphoreType.DMA((2,)),
              pltpu.VMEM((G, LANES), jnp.float32),
              pltpu.VMEM((G, LANES), jnp.float32),
              pltpu.VMEM((G, E), jnp.float32),
              pltpu.SMEM((1,), jnp.int32),
          ]),
      out_shape=jax.ShapeDtypeStruct((N, G, E), q_NGE.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
  )(qpos_B.astype(jnp.int32), vstart, ids_R1C, ids_R1C, q_NGE, k_NSE, table_RE)


def _gpu_kernel(qpos_ref, vstart_ref, ids_ref, q_ref, k_ref, table_ref, o_ref, l_ref, m_ref,
                *, K, window, local_rows, split, per_split):
  """One (row, split) program: the split's blocks inside the query's window, each
  gathered from the table by pointer (Triton's gather load) as it is used."""
  n, sp = pl.program_id(0), pl.program_id(1)
  h = jax.lax.rem(n, np.int32(K))
  qpos = qpos_ref[0]
  first = _div(jnp.maximum(jnp.maximum(qpos - window, 0), sp * per_split), GPU_BLOCK)
  last = _div(jnp.minimum(qpos, (sp + 1) * per_split - 1), GPU_BLOCK)  # may be < first
  q = q_ref[...]
  scale = 1.0 / math.sqrt(q.shape[-1])

  def body(blk, carry):
    o, m, l = carry
    at = pl.ds(blk * GPU_BLOCK, GPU_BLOCK)
    tok = ids_ref[at] - vstart_ref[0]
    mine = (tok >= 0) & (tok < local_rows)
    v = table_ref[jnp.where(mine, tok, 0) * K + h, :]
    if split:  # rows another shard holds count as zero here; the psum adds them
      v = jnp.where(mine[:, None], v, jnp.zeros((), v.dtype))
    s = plgpu.dot(q, k_ref[at, :], trans_b=True).astype(jnp.float32) * scale
    delta = qpos - (blk * GPU_BLOCK + jnp.arange(GPU_BLOCK))
    s = jnp.where(((delta >= 0) & (delta <= window))[None, :], s, MASKED)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_next[:, None])
    alpha = jnp.exp(m - m_next)
    o = alpha[:, None] * o + plgpu.dot(p.astype(q.dtype), v.astype(q.dtype)).astype(jnp.float32)
    return o, m_next, alpha * l + jnp.sum(p, axis=1)

  init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full(m_ref.shape, MASKED, jnp.float32),
          jnp.zeros(l_ref.shape, jnp.float32))
  o, m, l = jax.lax.fori_loop(first, last + 1, body, init)
  o_ref[...], m_ref[...], l_ref[...] = o, m, l


def _call_gpu(q_NGE, k_NSE, ids_BS, table_VF, qpos_B, vstart, *, window, split, interpret):
  N, G, E = q_NGE.shape
  B, S = ids_BS.shape
  K = N // B
  V = table_VF.shape[0]
  splits = math.gcd(GPU_SPLITS, S // GPU_BLOCK)
  per_split = S // splits
  R = max(GPU_ROWS, 1 << (G - 1).bit_length())  # Triton's tensors: powers of two
  q_NRE = jnp.pad(q_NGE, ((0, 0), (0, R - G), (0, 0)))
  kernel = functools.partial(_gpu_kernel, K=K, window=window, local_rows=V, split=split,
                             per_split=per_split)
  o, l, m = pl.pallas_call(
      kernel,
      grid=(N, splits),
      in_specs=[
          pl.BlockSpec((1,), lambda n, sp: (n // K,)),
          pl.BlockSpec((1,), lambda n, sp: (0,)),
          pl.BlockSpec((None, S), lambda n, sp: (n // K, 0)),
          pl.BlockSpec((None, R, E), lambda n, sp: (n, 0, 0)),
          pl.BlockSpec((None, S, E), lambda n, sp: (n, 0, 0)),
          pl.BlockSpec((V * K, E), lambda n, sp: (0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, R, E), lambda n, sp: (sp, n, 0, 0)),
          pl.BlockSpec((None, None, R), lambda n, sp: (sp, n, 0)),
          pl.BlockSpec((None, None, R), lambda n, sp: (sp, n, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((splits, N, R, E), jnp.float32),
                 jax.ShapeDtypeStruct((splits, N, R), jnp.float32),
                 jax.ShapeDtypeStruct((splits, N, R), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
  )(qpos_B.astype(jnp.int32), vstart, ids_BS.astype(jnp.int32), q_NRE, k_NSE,
    table_VF.reshape(V * K, E))
  # The splits' partial softmaxes joined (a split without visible keys has m at
  # MASKED and weighs nothing).
  m_all = jnp.max(m, axis=0)
  w = jnp.exp(m - m_all)
  out = jnp.sum(o * w[..., None], axis=0) / jnp.sum(l * w, axis=0)[..., None]
  return out[:, :G].astype(q_NGE.dtype)


def attend(q_BTHE, k_NSE, ids_BS, table_VF, qpos_B, window: int, gamma=None,
           kernel: str | None = None):
  """Attention output [B, 1, H * E] of one new token per sequence over its cache.

  q_BTHE [B, 1, H, E]; k_NSE the layer's key cache (`attention.kv_rows`); ids_BS
  the cached token ids; table_VF the layer's table [V, K * E]; qpos_B each query's
  position (keys qpos - window .. qpos are visible); gamma the layer's learned
  coefficient (None: 1). Equal to `attention.attend` over gamma * table[ids] rows.
  kernel: `tpu` or `gpu` (default: the backend's; off both, TPU's, interpreted).
  """
  B, T, H, E = q_BTHE.shape
  if T != 1:
    raise ValueError(f"bank_decode.attend takes one new token per sequence, got {T}")
  N = k_NSE.shape[0]
  K = N // B
  q_NGE = q_BTHE.reshape(B, K, H // K, E).reshape(N, H // K, E)
  backend = jax.default_backend()
  kernel = kernel or ("gpu" if backend == "gpu" else "tpu")
  call = {"tpu": _call_tpu, "gpu": _call_gpu}[kernel]
  interpret = backend != kernel
  window = int(min(window, k_NSE.shape[1]))
  split = mesh_split(B, table_VF.shape[0])
  if split is None:
    raise ValueError("bank_decode.attend: the mesh splits the batch and the table over a "
                     "shared axis; `resolve` sends this case to XLA's lookup")
  batch_axes, vocab = split

  def local(q, k, ids, table, qpos):
    # With a vocab-split table this shard's rows start at its index times its rows;
    # the others count as zero here and the psum adds them.
    vstart = jax.lax.axis_index(vocab) * table.shape[0] if vocab else 0
    out = call(q, k, ids, table, qpos, jnp.asarray(vstart, jnp.int32)[None], window=window,
               split=bool(vocab), interpret=interpret)
    return jax.lax.psum(out.astype(jnp.float32), vocab).astype(out.dtype) if vocab else out

  if batch_axes or vocab:
    rows = P(batch_axes or None)  # rows n = b * K + h: a batch split keeps a sequence's rows
    local = jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                          in_specs=(rows, rows, rows, P(vocab or None, None), rows),
                          out_specs=rows, check_vma=False)
  out = local(q_NGE, k_NSE, ids_BS, table_VF, qpos_B)
  if gamma is not None:
    out = gamma.astype(out.dtype) * out
  return out.reshape(B, 1, H * E)
