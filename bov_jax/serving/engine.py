"""A long-lived engine: the model held once, requests decoded by continuous batching.

Requests wait in a queue. Between decode calls the engine prefills waiting requests into
free slots; then jitted decode calls (as many as take the least time, from each call
shape's time measured at start-up) advance every active slot by `decode_steps`
tokens (what a slot draws past its end is dropped); a sequence that finishes (or whose
client went away) frees its slot and its pages when the call returns. The cache is
paged (pages.py): a pool sized from a byte budget, pages taken as a sequence grows and
returned when it ends; a bank layer's pages hold keys only, so a BoV model fits more
sequences in the same bytes. A request is admitted only while the free pages also
cover the next call's growth of the sequences in flight. When a growing sequence
finds no free page all the same, the newest sequence in flight gives its pages back
and waits at the head of the queue, to be prefilled again with what it has generated
(vLLM's recompute preemption), so no request is lost and the oldest always progress.
As JetStream's prefill/insert/generate and levanter's inference engine, in one
background thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time

import numpy as np

from bov_jax.model import kvcache
from bov_jax.serving import pages as pages_lib
from bov_jax.serving import programs as programs_lib

DECODE_STEPS = 16  # decode steps a device call runs (docs/performance.md, "Serving")


class QueueFull(Exception):
  """The queue holds `max_queue` requests: try again later."""


@dataclasses.dataclass
class Request:
  """A completion request and its progress. `on_event(kind, payload)` is called from the
  engine's thread: ("text", new text), then ("done", {"finish_reason", "usage"})."""
  prompt: list[int]
  max_tokens: int
  on_event: object
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple = ()
  ignore_eos: bool = False  # vLLM's setting: decode max_tokens even past <|bos|>
  arrived: float = dataclasses.field(default_factory=time.perf_counter)
  generated: list = dataclasses.field(default_factory=list)
  cancelled: bool = False
  sent: int = 0  # characters of the completion's text sent so far
  first_token_s: float | None = None
  order: int = 0  # admission order: the newest in flight is preempted first


@dataclasses.dataclass(frozen=True)
class Limits:
  """The engine's fixed shapes and budget."""
  slots: int
  page_size: int
  num_pages: int
  context: int
  max_queue: int
  decode_steps: int = 1  # decode steps a device call runs (programs.py)

  @property
  def max_pages(self) -> int:
    return -(-self.context // self.page_size)


def limits_for(model, context: int, slots: int, page_size: int, cache_bytes: int | None,
               max_queue: int, decode_steps: int = DECODE_STEPS) -> Limits:
  """The shapes for a byte budget (default: every slot's whole context); page 0 is the
  one that no sequence holds."""
  if slots < 1 or page_size < 1 or max_queue < 1 or decode_steps < 1:
    raise ValueError(f"--slots={slots}, --page_size={page_size}, --max_queue={max_queue} "
                     f"and --decode_steps={decode_steps} must be positive")
  per_page = kvcache.page_bytes(model, page_size)
  if cache_bytes is None:
    num_pages = slots * -(-context // page_size) + 1
  else:
    num_pages = cache_bytes // per_page
    if num_pages < 2:
      raise ValueError(f"--cache_bytes={cache_bytes} holds {num_pages} page(s) of {per_page} "
                       "bytes; it needs at least 2")
  return Limits(slots, page_size, int(num_pages), context, max_queue, decode_steps)


class Engine:

  def __init__(self, graphdef, params, tokenizer, limits: Limits, prefill_lengths=None):
    self.limits, self.tok = limits, tokenizer
    self.pool = pages_lib.PagePool(limits.num_pages, limits.page_size, limits.slots,
                                   limits.max_pages)
    self.programs = programs_lib.Programs(graphdef, params, limits.slots, limits.num_pages,
                                          limits.page_size, limits.max_pages,
                                          steps=limits.decode_steps)
    self.sampling = programs_lib.Sampling(limits.slots)
    self.prefill_lengths = sorted(prefill_lengths or _buckets(limits.context,
                                                              limits.page_size))
    self.queue: collections.deque[Request] = collections.deque()
    self.slots: list[Request | None] = [None] * limits.slots
    self.tokens = np.zeros(limits.slots, np.int32)  # each slot's next input token
    self.lock = threading.Condition()
    self.running, self.thread = False, None
    self.admitted = itertools.count()
    self.recent = collections.deque()  # (time, tokens) of the last decode steps
    self.counts = collections.Counter()  # requests, tokens, preemptions
    self.call_seconds = None  # {(rows, span): a decode call's seconds}, from warm()
    self.ttft: collections.deque[float] = collections.deque(maxlen=4096)

  # -- the API's side ----------------------------------------------------------------

  def fits(self, prompt_len: int, max_tokens: int) -> str | None:
    """Why a request can never run here, or None."""
    if prompt_len < 1:
      return "the prompt holds no tokens"
    if prompt_len >= self.limits.context:
      return (f"the prompt is {prompt_len} tokens; the model's context is "
              f"{self.limits.context} (prompt + 1 at the most)")
    total = min(prompt_len + max_tokens, self.limits.context)
    if self.pool.pages_for(total) > self.limits.num_pages - 1:
      return (f"prompt + max_tokens = {total} positions need {self.pool.pages_for(total)} "
              f"pages; the cache holds {self.limits.num_pages - 1}")
    return None

  def submit(self, request: Request) -> None:
    with self.lock:
      if len(self.queue) >= self.limits.max_queue:
        raise QueueFull(f"{len(self.queue)} requests are waiting (--max_queue)")
      self.queue.append(request)
      self.counts["requests"] += 1
      self.lock.notify()

  def cancel(self, request: Request) -> None:
    with self.lock:
      request.cancelled = True
      self.lock.notify()

  def stats(self) -> dict:
    with self.lock:
      now = time.perf_counter()
      while self.recent and now - self.recent[0][0] > 10.0:
        self.recent.popleft()
      span = now - self.recent[0][0] if len(self.recent) > 1 else 0.0
      rate = sum(n for _, n in list(self.recent)[1:]) / span if span > 0 else 0.0
      return {"queue": len(self.queue), "active": sum(s is not None for s in self.slots),
              "slots": self.limits.slots, "pages_used": self.pool.used,
              "pages_free": len(self.pool.free), "tokens_per_s": rate,
              "requests": self.counts["requests"], "tokens": self.counts["tokens"],
              "preemptions": self.counts["preemptions"],
              "decode_steps": self.counts["decode_steps"],
              "peak_active": self.counts["peak_active"]}

  def start(self) -> None:
    """Compiles every program (a prefill per prompt length, the decode step), then serves
    in a background thread."""
    self.warm()
    self.running = True
    self.thread = threading.Thread(target=self._serve, name="bov_jax-engine", daemon=True)
    self.thread.start()

  def stop(self) -> None:
    """Stops serving: what is left (in flight or waiting) ends with "abort"."""
    with self.lock:
      self.running = False
      self.lock.notify()
    if self.thread is not None:
      self.thread.join(timeout=60)
    else:  # never started: only the queue holds requests
      while self.queue:
        self._end(self.queue.popleft(), "abort")

  def warm(self) -> None:
    """Compiles every program, and times the decode calls (`call_seconds`)."""
    table = self.pool.table  # all page 0: the writes land on the page no sequence holds
    for length in self.prefill_lengths:
      for rows in self.programs.prefill_rows:
        self.programs.prefill([(0, [0], 0)] * rows, length, table, self.sampling.all())
    self.call_seconds = self.programs.warm(self.limits.num_pages)

  # -- the engine's thread -------------------------------------------------------------

  def _serve(self) -> None:
    while True:
      with self.lock:
        while self.running and not self.queue and not any(self.slots):
          self.lock.wait()
        if not self.running:
          break
        self._drop_cancelled()
        admitted = self._admit()
      self._prefill(admitted)
      if any(self.slots):
        self._step()
    for slot, request in enumerate(self.slots):  # stopped: whatever is left ends here
      if request is not None:
        self._finish(slot, "abort")
    while self.queue:
      self._end(self.queue.popleft(), "abort")

  def _drop_cancelled(self) -> None:
    for slot, request in enumerate(self.slots):
      if request is not None and request.cancelled:
        self._free(slot)
    self.queue = collections.deque(r for r in self.queue if not r.cancelled)

  def _admit(self) -> list[tuple[int, Request]]:
    """Waiting requests into free slots, oldest first, while the free pages hold their
    prompts and the next decode call's growth of every sequence in flight (theirs
    included): a request admitted into pages that the next call needs would only be
    preempted again (vLLM keeps a watermark of free blocks likewise)."""
    out = []
    reserve = sum(self.pool.pages_for(self._reach(r)) - self.pool.held[s]
                  for s, r in enumerate(self.slots) if r is not None)
    for slot in range(self.limits.slots):
      if self.slots[slot] is not None or not self.queue:
        continue
      request = self.queue[0]
      need = self.pool.pages_for(self._reach(request, ahead=1))  # after its prefill's token
      if need + reserve > len(self.pool.free):
        break
      if not self.pool.grow(slot, len(request.prompt) + len(request.generated)):
        break
      reserve += need - self.pool.held[slot]
      self.queue.popleft()
      request.order = next(self.admitted)
      self.slots[slot] = request
      out.append((slot, request))
    return out

  def _reach(self, request: Request, ahead: int = 0) -> int:
    """The positions a request's next decode call writes: its next `decode_steps`, at
    least one, no more than it can use (`ahead`: tokens it draws before that call)."""
    position = len(request.prompt) + len(request.generated) + ahead - 1
    last = min(len(request.prompt) + request.max_tokens - 1, self.limits.context)
    return max(position + 1, min(position + self.limits.decode_steps, last))

  def _prefill(self, admitted: list[tuple[int, Request]]) -> None:
    """The admitted requests' prompts into their slots, those of one padded length
    together (up to the programs' largest prefill), and each one's first token."""
    by_length = collections.defaultdict(list)
    for slot, request in admitted:
      ids = request.prompt + request.generated  # a preempted request resumes from here
      self.sampling.set(slot, request.temperature, request.top_k, request.top_p, request.seed)
      padded = next(n for n in self.prefill_lengths if n >= len(ids))
      by_length[padded].append((slot, request, ids))
    most = self.programs.prefill_rows[-1]
    for padded, group in by_length.items():
      for at in range(0, len(group), most):
        part = group[at:at + most]
        tokens = self.programs.prefill([(slot, ids, len(r.generated)) for slot, r, ids in part],
                                       padded, self.pool.table, self.sampling.all())
        self.counts["prefill_calls"] += 1
        for (slot, request, _), token in zip(part, tokens):
          self._emit(slot, request, token)

  def _step(self) -> None:
    """Pages for every active slot's next positions, as many as a decode call runs and
    its request can still use (the newest gives its own back where none are free), then
    one decode call of all slots; a slot's tokens after its end are dropped."""
    steps = self.limits.decode_steps
    for slot in sorted((s for s, r in enumerate(self.slots) if r is not None),
                       key=lambda s: self.slots[s].order):
      request = self.slots[slot]
      if request is None:
        continue
      while not self.pool.grow(slot, self._reach(request)):
        self._preempt()
        if self.slots[slot] is None:
          break
    active = np.asarray([r is not None for r in self.slots])
    if not active.any():
      return
    index = np.asarray([len(r.generated) if r else 0 for r in self.slots], np.int32)
    out = np.zeros((self.limits.slots, steps), np.int32)
    for group in self._groups(np.flatnonzero(active)):
      self.counts["decode_calls"] += 1
      mask = np.zeros_like(active)
      mask[group] = True
      held = max(self.pool.held[s] for s in group)
      out[group] = self.programs.decode(self.tokens, mask, self.pool.table, self.sampling.all(),
                                        index, held)[group]
    emitted = self.counts["tokens"]
    for slot, request in enumerate(self.slots):
      for k in range(steps):
        if self.slots[slot] is not request or request is None:
          break
        self._emit(slot, request, int(out[slot, k]))
    with self.lock:
      self.recent.append((time.perf_counter(), self.counts["tokens"] - emitted))
      self.counts["decode_steps"] += steps
      self.counts["peak_active"] = max(self.counts["peak_active"], int(active.sum()))

  def _groups(self, slots) -> list:
    """The active slots split into the decode calls that take the least time together,
    by the calls' timed costs (`call_seconds`): a call's rows all read as many pages as
    its longest holds (its bucket), so short sequences may go apart from long ones, and
    where a large call costs more than two halves (a CPU's caches outgrown) it is split.
    Calls take runs of the slots sorted by pages held, cut where a bucket's span changes
    or at a multiple of the smallest row bucket."""
    by_held = sorted(slots, key=lambda s: self.pool.held[s])
    if self.call_seconds is None:  # not timed yet: one call
      return [by_held]
    rows, spans = self.programs.row_buckets, self.programs.page_buckets
    span = [next(b for b in spans if b >= self.pool.held[s]) for s in by_held]
    n = len(by_held)
    cuts = sorted({0, n} | set(range(rows[0], n, rows[0]))
                  | {i for i in range(1, n) if span[i] != span[i - 1]})

    def cost(i, j):  # slots i..j-1 in one call
      return self.call_seconds[(next(b for b in rows if b >= j - i), span[j - 1])]

    best = {0: (0.0, [])}  # cut -> (seconds, the cuts before it)
    for j in cuts[1:]:
      best[j] = min((best[i][0] + cost(i, j), best[i][1] + [i]) for i in cuts if i < j)
    bounds = best[n][1][1:] + [n]
    return [by_held[i:j] for i, j in zip([0] + bounds[:-1], bounds)]

  def _preempt(self) -> None:
    slot = max((s for s, r in enumerate(self.slots) if r is not None),
               key=lambda s: self.slots[s].order)
    request = self.slots[slot]
    self._free(slot)
    with self.lock:
      self.queue.appendleft(request)
      self.counts["preemptions"] += 1

  def _emit(self, slot: int, request: Request, token: int) -> None:
    """A new token of a slot's sequence: its text sent, and the sequence ended where it
    must (<|bos|>, a stop string, max_tokens, the context)."""
    if request.first_token_s is None:
      request.first_token_s = time.perf_counter() - request.arrived
      with self.lock:
        self.ttft.append(request.first_token_s)
        self.counts["first_tokens"] += 1
    request.generated.append(token)
    self.tokens[slot] = token
    with self.lock:
      self.counts["tokens"] += 1
    reason = None
    if token == self.tok.bos_id and not request.ignore_eos:
      reason = "stop"
    text = self.tok.decode([t for t in request.generated if t != self.tok.bos_id])
    for stop in request.stop:
      at = text.find(stop)
      if at >= 0:
        text, reason = text[:at], "stop"
    if reason is None and (len(request.generated) >= request.max_tokens
                           or len(request.prompt) + len(request.generated)
                           >= self.limits.context):
      reason = "length"
    hold = 0 if reason else max([len(s) - 1 for s in request.stop] + [0])
    if not reason and text.endswith("\ufffd"):  # a character cut between tokens
      hold = max(hold, 1)
    ready = len(text) - hold
    if ready > request.sent:
      request.on_event("text", text[request.sent:ready])
      request.sent = ready
    if reason:
      self._finish(slot, reason)

  def _finish(self, slot: int, reason: str) -> None:
    request = self.slots[slot]
    self._free(slot)
    self._end(request, reason)

  def _end(self, request: Request, reason: str) -> None:
    request.on_event("done", {"finish_reason": reason, "usage": {
        "prompt_tokens": len(request.prompt), "completion_tokens": len(request.generated),
        "total_tokens": len(request.prompt) + len(request.generated)}})

  def _free(self, slot: int) -> None:
    self.pool.release(slot)
    self.slots[slot] = None


def _buckets(context: int, page_size: int) -> list[int]:
  """Prompt lengths a prefill is compiled for: powers of two from a page up, and the
  context."""
  out, n = [], max(page_size, 16)
  while n < context:
    out.append(n)
    n *= 2
  return out + [context]
