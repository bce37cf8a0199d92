"""Command: a run directory or an exported folder served over the OpenAI completions API
(serving/: a continuous-batching engine over a paged cache, and its HTTP API).

  python -m bov_jax.serve --workdir=RUN_OR_EXPORTED_FOLDER [--port=8000] [--host=127.0.0.1]
      [--api_key=KEY] [--slots=16] [--page_size=16] [--cache_bytes=N] [--max_queue=256]

It compiles its programs, then prints one line saying where it listens. It listens on
localhost unless --host says otherwise, and a host other than localhost needs --api_key
(or BOV_API_KEY). SIGTERM finishes the requests in flight (for up to --drain_s) and
exits 0.
"""

from __future__ import annotations

import ipaddress
import os
import sys

from absl import app
from absl import flags

from bov_jax import cli
from bov_jax.host import extras
from bov_jax.serving import load

_WORKDIR = flags.DEFINE_string("workdir", None, "a finished run directory or an exported folder")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "the address to listen on")
_PORT = flags.DEFINE_integer("port", 8000, "the port to listen on (0: any free one)")
_API_KEY = flags.DEFINE_string("api_key", os.environ.get("BOV_API_KEY"),
                               "the key clients send (Authorization: Bearer KEY); needed when "
                               "--host is not localhost (default: $BOV_API_KEY)")
_NAME = flags.DEFINE_string("model_name", None, "the model's name in the API (default: the "
                            "folder's name)")
_SLOTS = flags.DEFINE_integer("slots", 16, "sequences decoded at once")
_PAGE = flags.DEFINE_integer("page_size", 16, "positions per cache page")
_CACHE_BYTES = flags.DEFINE_integer("cache_bytes", None, "the paged cache's budget in bytes "
                                    "(default: every slot's whole context)")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "requests that may wait for a slot; "
                                  "more get 429")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", load.engine_lib.DECODE_STEPS,
                                     "decode steps a device call runs "
                                     "(new requests join between calls)")
_DRAIN = flags.DEFINE_integer("drain_s", 30, "on SIGTERM, how long requests in flight may "
                              "take to finish")


def _loopback(host: str) -> bool:
  try:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir=DIR (a run directory or an exported folder) is required")
  if not _loopback(_HOST.value) and not _API_KEY.value:
    cli.bad_input(f"--host={_HOST.value} exposes the server beyond this machine: give it "
                  "--api_key=KEY (or BOV_API_KEY)")
  extras.require("fastapi", "serve", "bov_jax.serve")
  extras.require("uvicorn", "serve", "bov_jax.serve")
  import uvicorn  # an optional extra: imported once it is known to be there

  try:
    engine, name = load.engine(_WORKDIR.value, _SLOTS.value, _PAGE.value, _CACHE_BYTES.value,
                               _MAX_QUEUE.value, _DECODE_STEPS.value)
  except (ValueError, OSError) as e:
    return cli.failed(e)
  from bov_jax.serving import server  # FastAPI: the serve extra, known to be there now
  app_ = server.make_app(engine, _NAME.value or name, _API_KEY.value, start=False)
  engine.start()  # compiles before the server says it listens
  config = uvicorn.Config(app_, host=_HOST.value, port=_PORT.value, log_level="warning",
                          timeout_graceful_shutdown=_DRAIN.value)
  srv = uvicorn.Server(config)

  def announce():
    port = srv.servers[0].sockets[0].getsockname()[1] if srv.servers else _PORT.value
    limits = engine.limits
    print(f"bov_jax.serve: listening on http://{_HOST.value}:{port} (model "
          f"{_NAME.value or name}; {limits.slots} slots, {limits.num_pages - 1} cache pages of "
          f"{limits.page_size} positions)", flush=True)

  _serve(srv, announce)
  return 0


def _serve(srv, announce) -> None:
  """uvicorn's server, announcing once it is bound (SIGINT and SIGTERM shut it down
  gracefully: uvicorn's own handlers)."""
  import asyncio
  import signal

  # uvicorn drains on SIGTERM, then raises it again for the handler it found: a no-op
  # one, so a drained server exits 0 instead of dying by the signal.
  signal.signal(signal.SIGTERM, lambda *_: None)

  async def run():
    task = asyncio.create_task(srv.serve())
    while not srv.started and not task.done():
      await asyncio.sleep(0.05)
    if srv.started:
      announce()
    await task

  asyncio.run(run())


if __name__ == "__main__":
  cli.run(lambda argv: sys.exit(main(argv)))
