"""The OpenAI completions API over the engine, on FastAPI: `POST /v1/completions` (a
prompt as text or token ids; `stream` as server-sent events), `GET /v1/models`,
`GET /health`, and `GET /metrics` in Prometheus' text format.

Bad input gets a 4xx answer whose message names the field and its limit, in OpenAI's
error shape; a full queue gets 429 with `Retry-After`; a client that goes away cancels
its request, which frees its slot and pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import fastapi
import prometheus_client
from fastapi import responses

from bov_jax.serving import engine as engine_lib

MAX_STOPS = 4  # OpenAI's limit on stop sequences


class BadRequest(Exception):

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.param, self.status, self.kind = param, status, kind


def error(status: int, message: str, param: str | None = None,
          kind: str = "invalid_request_error", headers: dict | None = None):
  return responses.JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                           "code": None}}, status_code=status, headers=headers)


def make_app(engine: engine_lib.Engine, model_name: str, api_key: str | None = None,
             start: bool = True) -> fastapi.FastAPI:
  """The app; with `start`, its lifespan starts the engine (compiling its programs) and
  stops it when the server shuts down, after the requests in flight."""

  @contextlib.asynccontextmanager
  async def lifespan(app):
    if start:
      engine.start()
    yield
    engine.stop()

  app = fastapi.FastAPI(title="bov_jax", lifespan=lifespan)
  metrics = _Metrics(engine)
  created = int(time.time())

  @app.middleware("http")
  async def authorize(request: fastapi.Request, call_next):
    if api_key and request.url.path.startswith("/v1/"):
      if request.headers.get("authorization", "") != f"Bearer {api_key}":
        return error(401, "a valid API key is required: Authorization: Bearer KEY",
                     kind="authentication_error")
    return await call_next(request)

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": created, "owned_by": "bov_jax"}]}

  @app.get("/metrics")
  async def prometheus():
    return responses.Response(metrics.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    try:
      body = _json(await request.body())
      job = _parse(body, engine, model_name)
    except BadRequest as e:
      return error(e.status, str(e), e.param, e.kind)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job.on_event = lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait,
                                                                   (kind, payload))
    try:
      engine.submit(job)
    except engine_lib.QueueFull as e:
      return error(429, f"the server is busy: {e}; retry later", kind="rate_limit_error",
                   headers={"Retry-After": "1"})
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model_name}
    if body.get("stream"):
      usage = bool((body.get("stream_options") or {}).get("include_usage"))
      return responses.StreamingResponse(_stream(engine, job, events, head, usage),
                                         media_type="text/event-stream")
    return await _whole(engine, job, events, head, request)

  return app


def _json(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f"the request body is not JSON: {e}") from e
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object")
  return body


def _number(body, name, default, kind, low, high, low_open=False):
  value = body.get(name, default)
  if value is None:
    value = default
  if isinstance(value, bool) or not isinstance(value, kind):
    raise BadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                     f"got {value!r}", name)
  bound = "(" if low_open else "["
  if (value <= low if low_open else value < low) or value > high:
    raise BadRequest(f"{name}={value} is out of range: expected {bound}{low}, {high}]", name)
  return value


def _parse(body: dict, engine: engine_lib.Engine, model_name: str) -> engine_lib.Request:
  """The request as the engine takes it; BadRequest names the field that is wrong."""
  if body.get("model") not in (None, model_name):
    raise BadRequest(f"model {body.get('model')!r} does not exist: this server serves "
                     f"{model_name!r}", "model", status=404, kind="not_found_error")
  for name in ("echo", "logprobs", "suffix", "best_of"):
    if body.get(name):
      raise BadRequest(f"{name} is not supported", name)
  if body.get("n", 1) != 1:
    raise BadRequest(f"n={body.get('n')!r}: only n=1 is supported", "n")
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # one prompt in a batch of one
  if isinstance(prompt, str):
    ids = engine.tok.encode(prompt)  # <|bos|> in front, as the model was trained
  elif (isinstance(prompt, list) and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
    vocab = engine.programs.vocab_size
    if any(t < 0 or t >= vocab for t in prompt):
      raise BadRequest(f"prompt holds a token id outside [0, {vocab})", "prompt")
    ids = list(prompt)
  else:
    raise BadRequest("prompt must be a string or a list of token ids (one prompt)", "prompt")
  context = engine.limits.context
  max_tokens = _number(body, "max_tokens", 16, int, 1, context - 1)
  temperature = float(_number(body, "temperature", 1.0, (int, float), 0.0, 2.0))
  top_p = float(_number(body, "top_p", 1.0, (int, float), 0.0, 1.0, low_open=True))
  top_k = _number(body, "top_k", 0, int, -1, 1 << 30)
  seed = _number(body, "seed", 0, int, -(1 << 31), (1 << 31) - 1)
  stop = body.get("stop") or []
  stop = [stop] if isinstance(stop, str) else stop
  if (not isinstance(stop, list) or len(stop) > MAX_STOPS
      or not all(isinstance(s, str) and s for s in stop)):
    raise BadRequest(f"stop must be a string or a list of at most {MAX_STOPS} non-empty "
                     "strings", "stop")
  if (why := engine.fits(len(ids), max_tokens)) is not None:
    raise BadRequest(why, "prompt" if "prompt" in why.split(";")[0] else "max_tokens")
  return engine_lib.Request(prompt=ids, max_tokens=max_tokens, on_event=None,
                            temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                            seed=seed, stop=tuple(stop))


async def _whole(engine, job, events, head, request: fastapi.Request):
  """The whole completion; the request is cancelled if the client goes away first."""
  text = []
  while True:
    try:
      kind, payload = await asyncio.wait_for(events.get(), timeout=0.5)
    except TimeoutError:
      if await request.is_disconnected():
        engine.cancel(job)
        return responses.Response(status_code=499)
      continue
    if kind == "text":
      text.append(payload)
      continue
    if payload["finish_reason"] == "abort":
      return error(503, "the server stopped before the request finished", kind="server_error",
                   headers={"Retry-After": "1"})
    return dict(head, choices=[{"text": "".join(text), "index": 0, "logprobs": None,
                                "finish_reason": payload["finish_reason"]}],
                usage=payload["usage"])


async def _stream(engine, job, events, head, include_usage: bool):
  """Server-sent events, OpenAI's chunks; a client that goes away cancels the request."""
  try:
    while True:
      kind, payload = await events.get()
      if kind == "text":
        chunk = dict(head, choices=[{"text": payload, "index": 0, "logprobs": None,
                                     "finish_reason": None}])
        yield f"data: {json.dumps(chunk)}\n\n"
        continue
      reason = payload["finish_reason"]
      last = dict(head, choices=[{"text": "", "index": 0, "logprobs": None,
                                  "finish_reason": None if reason == "abort" else reason}])
      yield f"data: {json.dumps(last)}\n\n"
      if include_usage:
        yield f"data: {json.dumps(dict(head, choices=[], usage=payload['usage']))}\n\n"
      yield "data: [DONE]\n\n"
      return
  finally:
    engine.cancel(job)  # a no-op once it has finished; frees its slot where it has not


class _Metrics:
  """The engine's state in Prometheus' text format."""

  def __init__(self, engine):
    self.engine = engine
    self.registry = prometheus_client.CollectorRegistry()
    gauge = lambda name, doc: prometheus_client.Gauge(name, doc, registry=self.registry)  # noqa: E731
    self.gauges = {
        "queue": gauge("bov_queue_length", "requests waiting for a slot"),
        "active": gauge("bov_active_slots", "sequences being decoded"),
        "pages_used": gauge("bov_cache_pages_used", "cache pages held by sequences"),
        "pages_free": gauge("bov_cache_pages_free", "cache pages free"),
        "tokens_per_s": gauge("bov_output_tokens_per_second",
                              "tokens generated per second over the last 10 s"),
        "requests": gauge("bov_requests_total", "requests accepted"),
        "tokens": gauge("bov_output_tokens_total", "tokens generated"),
        "preemptions": gauge("bov_preemptions_total", "sequences sent back to the queue")}
    self.ttft = prometheus_client.Histogram(
        "bov_time_to_first_token_seconds", "from a request's arrival to its first token",
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
    self.seen = 0

  def render(self) -> bytes:
    stats = self.engine.stats()
    for name, g in self.gauges.items():
      g.set(stats[name])
    firsts = self.engine.counts["first_tokens"]  # observed: those since the last render
    for value in list(self.engine.ttft)[len(self.engine.ttft) - min(firsts - self.seen,
                                                                    len(self.engine.ttft)):]:
      self.ttft.observe(value)
    self.seen = firsts
    return prometheus_client.generate_latest(self.registry)
