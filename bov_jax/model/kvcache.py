"""The decoding cache, and one layer's attention of new tokens over it (the paper,
Section 5: inference without a value cache for bank layers).

The cache, per sequence of the batch, up to `context` positions:
  layers  per stage of the model (spec.Stage), per layer position j of its block:
          {"k": keys [R, B * K, S, E], "v": values, likewise}, R the stage's repeats:
          a scanned stage carries its layers' caches stacked, and each layer
          writes its new positions in place. Rows B * K: one per sequence and kv
          head (`attention.kv_rows`, the layout attention's matmuls read). Values
          only for layers that compute their own (`LayerValue.computes_v`): a bank
          layer stores none and gathers gamma * E_i[ids] when it runs; a V1-replace
          layer reads layer 0's values instead of storing them again
  ids     the token ids, once for the whole model (only when a bank layer exists)
  prev    the previous token's pre-smear embedding (the smear gate needs it)
  pos     how many positions each sequence holds

A paged cache (`init_paged`, for serving many sequences at once) holds the same entries
in a pool of fixed-size pages instead: each layer's {"k": [R, pages * K, page, E], "v"
where it keeps values}, the ids [pages, page] once for the model, and a page table per
sequence ("pages" [B, max_pages]) naming the page of each run of `page` positions. A
layer reads its sequences' pages as the contiguous rows above (`_page_view`), so the
attention is the same code; page 0 is never handed out and takes the writes of
positions no page holds (a padded prompt's tail).

The model's one forward (`GPT.__call__` with a cache) calls `begin`, then `attend`
in every layer, which takes its part of the cache as a value and returns it
updated, then `end`. A decode step (one new token) of a sliding-window layer reads
only its window of the cache (`_window`); a bank layer's can gather inside the
attention kernel (`kernels/bank_decode.py`, `model.decode_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bov_jax.kernels import attention
from bov_jax.kernels import bank_decode
from bov_jax.model import combine
from bov_jax.parallel import lookup
from bov_jax.settings import values


@dataclasses.dataclass(frozen=True)
class LayerSettings:
  """What `attend` needs to know of a layer (static)."""
  layer_value: values.LayerValue
  window: int
  n_kv_head: int
  group: int               # query heads per kv head
  head_dim: int
  table_lookup: str
  tables_on_host: bool
  decode_attention: str    # xla | fused (model.decode_attention, resolved for the target)
  decode_kernel: str       # tpu | gpu
  decode_interpret: bool


def layer_settings(spec, layer_value, window: int) -> LayerSettings:
  return LayerSettings(layer_value, window, spec.n_kv_head, spec.n_head // spec.n_kv_head,
                       spec.head_dim, spec.table_lookup, spec.tables_on_host, spec.decode_attention,
                       spec.decode_kernel, spec.decode_interpret)


class LayerCache(NamedTuple):
  """One layer's view of the cache: its stage's entry for the layer's block position
  (stacked over repeats), the repeat r it is, and what every layer reads."""
  entry: dict           # {"k": [R, N, S, E], "v": ... where the layer keeps values}
  r: object             # repeat index (int or traced)
  whole: dict           # the cache: "pos", "ids"
  v1_entry: dict | None  # layer 0's entry (V1-replace layers read its values)


def init(model, batch: int, context: int) -> dict:
  """An empty cache for `batch` sequences of up to `context` positions (of the model's
  shapes: a model or its abstract structure)."""
  spec, dtype = model.spec, model.compute_dtype
  K, E = spec.n_kv_head, spec.head_dim
  rows = lambda R: jnp.zeros((R, batch * K, context, E), dtype)  # noqa: E731
  cache = {"layers": _layers(spec, rows), "prev": jnp.zeros((batch, spec.n_embd), dtype),
           "pos": jnp.zeros((batch,), jnp.int32)}
  if any(layer_value.is_bank for layer_value in spec.layers):
    cache["ids"] = jnp.zeros((batch, context), jnp.int32)
  return cache


def _layers(spec, buffer) -> list:
  """Per stage, per layer position of its block: {"k": buffer(R), "v": where the layer
  computes its values}."""
  return [[{"k": buffer(stage.repeats),
            **({"v": buffer(stage.repeats)} if spec.layers[stage.start + j].computes_v else {})}
           for j in range(stage.period)] for stage in spec.stages]


def page_bytes(model, page_size: int) -> int:
  """The bytes one page of a paged cache takes: every layer's keys, values only where
  the layer computes them (a bank layer's are its table's rows), the ids once."""
  spec = model.spec
  kv = spec.n_kv_head * spec.head_dim * page_size * jnp.dtype(model.compute_dtype).itemsize
  per_layer = sum(kv * (2 if layer_value.computes_v else 1) for layer_value in spec.layers)
  ids = 4 * page_size if any(layer_value.is_bank for layer_value in spec.layers) else 0
  return per_layer + ids


def init_paged(model, slots: int, num_pages: int, page_size: int, max_pages: int) -> dict:
  """An empty paged cache: a pool of `num_pages` pages of `page_size` positions, and
  `slots` sequences of up to `max_pages` pages each (their page tables all page 0)."""
  spec, dtype = model.spec, model.compute_dtype
  K, E = spec.n_kv_head, spec.head_dim
  pool = lambda R: jnp.zeros((R, num_pages * K, page_size, E), dtype)  # noqa: E731
  cache = {"layers": _layers(spec, pool), "prev": jnp.zeros((slots, spec.n_embd), dtype),
           "pos": jnp.zeros((slots,), jnp.int32),
           "pages": jnp.zeros((slots, max_pages), jnp.int32)}
  if any(layer_value.is_bank for layer_value in spec.layers):
    cache["ids"] = jnp.zeros((num_pages, page_size), jnp.int32)
  return cache


def _page_slots(pages_BM, start_B, T: int, page_size: int):
  """(page [B, T], offset [B, T]) of T positions from each sequence's start; page 0
  (written, never read) where no page of the table holds the position."""
  pos = start_B[:, None] + jnp.arange(T)[None, :]
  index = pos // page_size
  held = index < pages_BM.shape[1]
  page = jnp.take_along_axis(pages_BM, jnp.minimum(index, pages_BM.shape[1] - 1), axis=1)
  return jnp.where(held, page, 0), pos % page_size


def _write_pages(pool_RNPE, new_NTE, r, pages_BM, start_B, K: int):
  """The new positions' rows (b * K + h) written into their pages: row page * K + h."""
  page, offset = _page_slots(pages_BM, start_B, new_NTE.shape[1], pool_RNPE.shape[2])
  rows = (page[:, None, :] * K + jnp.arange(K)[None, :, None]).reshape(-1, page.shape[1])
  return pool_RNPE.at[r, rows, jnp.repeat(offset, K, axis=0)].set(new_NTE)


def _page_view(pool_NPE, pages_BM, K: int):
  """Each sequence's pages as contiguous rows [B * K, max_pages * page, E]."""
  rows = (pages_BM[:, None, :] * K + jnp.arange(K)[None, :, None]).reshape(-1, pages_BM.shape[1])
  view = pool_NPE[rows]  # [B * K, M, page, E]
  return view.reshape(view.shape[0], -1, view.shape[-1])


def gather_pages(cache: dict, pages_AM, K: int) -> dict:
  """The sequences of page-table rows `pages_AM` [A, M] out of a paged cache, as a
  contiguous cache of A sequences of M * page positions (`init`'s layout, "prev" and
  "pos" left to the caller): several decode steps then read their pages once."""
  A, M = pages_AM.shape

  def rows(pool_RNPE):
    R, N, P, E = pool_RNPE.shape
    idx = (pages_AM[:, None, :] * K + jnp.arange(K)[None, :, None]).reshape(-1)
    idx = (jnp.arange(R)[:, None] * N + idx[None, :]).reshape(-1)
    # whole pages as rows of one 2-d array, indices known in range: XLA's CPU gather
    # copies these faster than the 4-d indexing's (docs/performance.md, "Serving")
    view = jnp.take(pool_RNPE.reshape(R * N, P * E), idx, axis=0, mode="clip")
    return view.reshape(R, A * K, M * P, E)

  out = {"layers": jax.tree.map(rows, cache["layers"])}
  if "ids" in cache:
    out["ids"] = cache["ids"][pages_AM].reshape(pages_AM.shape[0], -1)
  return out


def scatter_pages(cache: dict, local: dict, pages_AM, start_A, T: int, K: int) -> dict:
  """The T positions from `start_A` of each sequence of a contiguous cache (`local`,
  gathered by `gather_pages` with the same table rows) written back into the paged
  cache's pages: what the steps in between added. Positions no page of a row holds go
  to page 0, as every paged write's do."""
  N = start_A.shape[0] * K
  pos_AT = start_A[:, None] + jnp.arange(T)[None, :]
  pos_NT = jnp.repeat(pos_AT, K, axis=0)

  def write(pool_RNPE, local_RNSE):
    page, offset = _page_slots(pages_AM, start_A, T, pool_RNPE.shape[2])
    rows = (page[:, None, :] * K + jnp.arange(K)[None, :, None]).reshape(N, T)
    new = local_RNSE[:, jnp.arange(N)[:, None], pos_NT]  # [R, N, T, E]
    return pool_RNPE.at[:, rows, jnp.repeat(offset, K, axis=0)].set(new)

  out = dict(cache, layers=jax.tree.map(write, cache["layers"], local["layers"]))
  if "ids" in cache:
    page, offset = _page_slots(pages_AM, start_A, T, cache["ids"].shape[1])
    new = local["ids"][jnp.arange(start_A.shape[0])[:, None], pos_AT]
    out["ids"] = cache["ids"].at[page, offset].set(new)
  return out


def by_layer(spec, cache: dict) -> list[dict]:
  """Layer i's part of the cache, {"k": [B * K, S, E], "v": ... where it keeps values},
  for i in order (for reading a cache; the model reads its stages whole)."""
  out = [None] * spec.n_layer
  for stage, entries in zip(spec.stages, cache["layers"]):
    for j, entry in enumerate(entries):
      for r, i in enumerate(stage.layers(j)):
        out[i] = {name: buf[r] for name, buf in entry.items()}
  return out


def logical_axes(cache: dict) -> dict:
  """The cache's logical axis names (sharding.RULES), a tuple per leaf: every buffer is
  split by sequence (its rows b * K + h, b-major, split as the batch is)."""
  def axes(path, x):
    if path[0].key == "layers":
      return (None, "batch", None, None)
    return ("batch",) + (None,) * (x.ndim - 1)
  return jax.tree_util.tree_map_with_path(axes, cache)


def nbytes(cache: dict) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def _write(buf, new, start):
  """buf[n, start[n]:start[n]+T] = new[n] for every row n."""
  return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0))(
      buf, new, start)


def _write_layer(buf_RNSE, new_NTE, r, start_N):
  """buf[r, n, start[n]:start[n]+T] = new[n]: one scatter into the stacked buffer, so a
  scanned stage's cache is updated where it lies."""
  N, T = new_NTE.shape[:2]
  pos = start_N[:, None] + jnp.arange(T)[None, :]
  return buf_RNSE.at[r, jnp.arange(N)[:, None], pos].set(new_NTE, unique_indices=True)


def begin(cache, idx_BT):
  """(the cache holding the new ids, their positions [B, T], the pre-smear embedding
  before each sequence's first new token or 0 where there is none). A paged cache also
  carries, for this forward only, every sequence's ids as contiguous rows."""
  start = cache["pos"]
  if "ids" in cache and "pages" in cache:
    page, offset = _page_slots(cache["pages"], start, idx_BT.shape[1], cache["ids"].shape[1])
    ids = cache["ids"].at[page, offset].set(idx_BT.astype(jnp.int32))
    view = ids[cache["pages"]]
    cache = dict(cache, ids=ids, ids_view=view.reshape(view.shape[0], -1))
  elif "ids" in cache:
    cache = dict(cache, ids=_write(cache["ids"], idx_BT.astype(jnp.int32), start))
  pos = start[:, None] + jnp.arange(idx_BT.shape[1])[None, :]
  return cache, pos, jnp.where((start > 0)[:, None], cache["prev"], 0)


def end(cache, last_pre_BD, T: int):
  """The cache after all layers ran T new tokens (last_pre: the last one's pre-smear
  embedding)."""
  cache = {k: v for k, v in cache.items() if k != "ids_view"}
  return dict(cache, prev=last_pre_BD, pos=cache["pos"] + T)


def _ids(whole) -> jax.Array:
  """Every sequence's cached ids [B, S]."""
  return whole["ids_view"] if "ids_view" in whole else whole["ids"]


def _values(layer: LayerSettings, c: LayerCache, table, coeffs, rows, seqs, view):
  """Values of the cached positions for a layer (bank and V1 layers rebuild them).
  `rows` and `seqs` cut a [B * K, S, E] buffer and the [B, S] ids to the positions
  attention reads (all of them, or a sliding window's: `_window`); `view` reads a
  buffer as those rows (a paged cache's pages)."""
  layer_value = layer.layer_value
  if layer_value.computes_v:
    return rows(view(c.entry["v"][c.r]))
  if layer_value.source == "v1":
    return combine.combine(layer_value, None, rows(view(c.v1_entry["v"][0])), coeffs)
  ids = seqs(_ids(c.whole))
  B, S = ids.shape
  vals = lookup.table_lookup(table, ids, layer.table_lookup, layer.tables_on_host)
  vals = vals.astype(c.entry["k"].dtype).reshape(B, S, layer.n_kv_head, layer.head_dim)
  # XLA writes the gathered rows straight into the layout attention reads (the
  # transpose folds into the gather).
  return combine.combine(layer_value, None, attention.kv_rows(vals), coeffs)


def _window(window: int, start_B, S: int, K: int):
  """For one decode step of a sliding-window layer: (rows, seqs, kpos_BW) cutting
  the cache to the W = window + 1 positions each query can see, or None where the
  window covers more than half the cache (cutting copies W positions, so it pays
  only when it skips more than it copies)."""
  W = window + 1
  if 2 * W > S:
    return None
  lo_B = jnp.clip(start_B - window, 0, S - W)  # the W positions hold start - window .. start
  lo_N = jnp.repeat(lo_B, K)
  cut = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, W, axis=0))
  return (lambda x: cut(x, lo_N), lambda x: cut(x, lo_B),
          lo_B[:, None] + jnp.arange(W)[None, :])


def fused_bank(layer: LayerSettings, batch: int, context: int, table_shape) -> bool:
  """Whether this layer's decode step runs `bank_decode`'s kernel (a bank layer whose
  gather it fuses; `model.decode_attention`)."""
  if not layer.layer_value.is_bank:
    return False
  return bank_decode.kernel_for(layer.decode_attention, context, layer.head_dim,
                                layer.tables_on_host, batch, table_shape,
                                platform=layer.decode_kernel) == "fused"


def attend(layer: LayerSettings, q_BTHE, k_BTKE, v_BTKE, c: LayerCache, table=None,
           coeffs=None):
  """A layer's attention [B, T, H * E] of T new positions per sequence over the cache,
  after writing their keys (and values, where the layer keeps them). Returns
  (output, the layer's stage entry updated)."""
  K = layer.n_kv_head
  B, T = q_BTHE.shape[:2]
  coeffs = coeffs or {}
  start = c.whole["pos"]
  if "pages" in c.whole:  # a paged cache: written into its pages, read as rows
    pages = c.whole["pages"]
    write = lambda buf, new: _write_pages(buf, new, c.r, pages, start, K)  # noqa: E731
    view = lambda buf: _page_view(buf, pages, K)  # noqa: E731
  else:
    start_N = jnp.repeat(start, K)  # each kv-head row's sequence
    write = lambda buf, new: _write_layer(buf, new, c.r, start_N)  # noqa: E731
    view = lambda buf: buf  # noqa: E731
  entry = dict(c.entry, k=write(c.entry["k"], attention.kv_rows(k_BTKE)))
  if layer.layer_value.computes_v:
    entry["v"] = write(entry["v"], attention.kv_rows(v_BTKE))
  c = c._replace(entry=entry)
  keys = view(entry["k"][c.r])
  S = keys.shape[1]
  if (T == 1 and "pages" not in c.whole
      and fused_bank(layer, B, S, None if table is None else table.shape)):
    y = bank_decode.attend(q_BTHE, keys, c.whole["ids"], table, start, layer.window,
                           coeffs.get("gamma"), kernel=layer.decode_kernel,
                           interpret=layer.decode_interpret)
    return y, entry
  cut = _window(layer.window, start, S, K) if T == 1 else None
  pos = start[:, None] + jnp.arange(T)[None, :]
  if layer.layer_value.is_bank and cut is None and S % BANK_BLOCK == 0 and S > BANK_BLOCK:
    return bank_in_blocks(layer, q_BTHE, keys, _ids(c.whole), table, coeffs, pos,
                          BANK_BLOCK), entry
  rows, seqs, kpos = cut or (lambda x: x, lambda x: x, jnp.broadcast_to(jnp.arange(S), (B, S)))
  y = attention.attend(q_BTHE, rows(keys), _values(layer, c, table, coeffs, rows, seqs, view),
                       pos, kpos, layer.window)
  return y, entry


BANK_BLOCK = 512  # cached positions a bank layer gathers at a time (XLA's path)


def bank_in_blocks(layer: LayerSettings, q_BTHE, k_NSE, ids_BS, table, coeffs, qpos_BT,
                   block: int):
  """A bank layer's attention over its whole cache a block of positions at a time, its
  values gathered block by block under a lax.scan with an online softmax (flash
  decoding): only one block's rows ever exist, not a value buffer as large as the
  value cache the layer saves (which prefill beside a full cache could not afford)."""
  B, T, H, E = q_BTHE.shape
  N, S, _ = k_NSE.shape
  K = N // B
  q_NME = attention.query_heads(q_BTHE, K).reshape(N, (H // K) * T, E)

  def body(carry, j):
    m, l, acc = carry
    keys = jax.lax.dynamic_slice_in_dim(k_NSE, j * block, block, axis=1)
    ids = jax.lax.dynamic_slice_in_dim(ids_BS, j * block, block, axis=1)
    rows = lookup.table_lookup(table, ids, layer.table_lookup,
                                layer.tables_on_host).astype(k_NSE.dtype)
    vals = combine.combine(layer.layer_value, None,
                           attention.kv_rows(rows.reshape(B, block, K, E)), coeffs)
    scores = jnp.einsum("nme,nse->nms", q_NME, keys,
                        preferred_element_type=jnp.float32) / np.sqrt(E)
    delta = qpos_BT[:, :, None] - (j * block + jnp.arange(block))[None, None, :]  # [B, T, s]
    visible = (delta >= 0) & (delta <= layer.window)
    visible = jnp.broadcast_to(visible[:, None, None], (B, K, H // K, T, block))
    scores = jnp.where(visible.reshape(N, -1, block), scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing visible yet
    p = jnp.exp(scores - shift)
    alpha = jnp.exp(m - shift)
    acc = alpha * acc + jnp.einsum("nms,nse->nme", p.astype(vals.dtype), vals,
                                   preferred_element_type=jnp.float32)
    return (m_new, alpha * l + jnp.sum(p, axis=-1, keepdims=True), acc), None

  M = q_NME.shape[1]
  init = (jnp.full((N, M, 1), -jnp.inf, jnp.float32), jnp.zeros((N, M, 1), jnp.float32),
          jnp.zeros((N, M, E), jnp.float32))
  (_, l, acc), _ = jax.lax.scan(body, init, jnp.arange(S // block))
  out = (acc / l).astype(q_BTHE.dtype).reshape(B, K, H // K, T, E)
  return attention.tokens_major(out)
