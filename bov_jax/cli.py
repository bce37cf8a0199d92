"""What every command shares: its exit codes (0 done, 1 the run or its environment
failed, 2 bad input), each failure one `error:` line.

`run(main)` is `absl.app.run` with this parser. absl's own reports a value of the wrong
type as a fatal error with exit 1, and ml_collections an unknown `--config.FIELD` as a
traceback; both are bad input, named here by the flag as written, with the setting's
likely intended name where ml_collections suggests one. `failed(e)` tells the two kinds of
failure apart: a full disk, a lost connection to a bucket, a device out of memory are the
environment's (1), whatever the library wraps them in; a setting, a file or a directory
that is not what was expected is the input's (2).
"""

from __future__ import annotations

import logging as pylogging
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging

from bov_jax.host import extras
from bov_jax.host import hugepages

FAILED = 1     # the README's exit codes: 0 done, 1 the run (or its environment) failed,
BAD_INPUT = 2  # 2 bad input
# absl status codes (tensorstore's, so orbax's, and XLA's) that name a failure of storage,
# the network or memory, not of what was asked
_STATUS = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED",
           "UNAUTHENTICATED", "ABORTED", "DATA_LOSS")
_NETWORK = ("aiohttp", "gcsfs", "google", "requests", "urllib3")  # their errors: the network's


def bad_input(message: str):
  print(f"error: {message}", file=sys.stderr)
  sys.exit(BAD_INPUT)


def parse_flags(argv):
  """absl's flag parsing, every failure one `error:` line and exit 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    bad_input(str(e).splitlines()[0])
  except (AttributeError, KeyError) as e:  # an unknown --config.FIELD (ml_collections)
    text = str(e).strip("'\"").replace("\\n", "\n").replace("\\'", "'")
    name = re.search(r"'?(\w+)'?", text)
    given = [a for a in argv[1:] if name and a.startswith("--config.")
             and re.search(rf"[.]{re.escape(name.group(1))}(=|$)", a.split("=", 1)[0] + "=")]
    hint = re.search(r'Did you mean "(\w+)"', text)
    bad_input(f"{given[0] if given else 'a --config setting'}: no such setting"
              + (f" (did you mean {hint.group(1)}?)" if hint else ""))


def environment_cause(e: BaseException) -> BaseException | None:
  """The failure of the machine, its storage or the network behind `e` (e itself or what
  raised it), or None. The library's own ValueErrors are bad input and carry their cause
  already judged (a Parquet page pyarrow cannot decode is the file's fault)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if str(e).startswith(_STATUS):
      return e
    if isinstance(e, ValueError):
      return None
    if isinstance(e, (MemoryError, ConnectionError, TimeoutError)) or (
        isinstance(e, OSError)
        and not isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError))):
      return e
    if type(e).__module__.split(".")[0] in _NETWORK:
      return e
    e = e.__cause__ or e.__context__
  return None


def _line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  return " ".join(text.split())


def failed(e: BaseException) -> int:
  """Prints `e` as the one `error:` line and returns its exit code: FAILED for the
  environment's failure (its cause named) or an optional extra that is not installed,
  BAD_INPUT otherwise."""
  if isinstance(e, extras.MissingExtra):  # its message is the `pip install` that mends it
    print(f"error: {e}", file=sys.stderr)
    return extras.EXIT
  cause = environment_cause(e)
  if cause is None:
    print(f"error: {e}", file=sys.stderr)
    return BAD_INPUT
  said = _line(e) if cause is e else f"{_line(e)}: {type(cause).__name__}: {_line(cause)}"
  print(f"error: {said} (the machine, its storage or the network failed, not the input; "
        "the same command can run again once that is mended)", file=sys.stderr)
  return FAILED


def _quiet() -> None:
  """The console keeps to the command's own lines: orbax and grain log every file
  operation at INFO, gcsfs a traceback per retry (its last failure is the error line)."""
  logging.set_verbosity(logging.WARNING)
  pylogging.getLogger("gcsfs").setLevel(pylogging.CRITICAL)


def cpu_when_no_accelerator() -> None:
  """With no accelerator here, JAX runs on the CPU without probing for one: libtpu
  (installed for --mode=compile) would log start-up errors looking for a TPU."""
  if "JAX_PLATFORMS" in os.environ or not hugepages.cpu_only():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # imported already: its setting read the environment before this
    sys.modules["jax"].config.update("jax_platforms", "cpu")


class Distributed:
  """The flags that start JAX's multi-process runtime, for the commands started on every
  host (main, lm_eval): flags win over JAX's environment variables; what neither gives is
  left to JAX's cluster detection (TPU pods, SLURM)."""

  def __init__(self):
    self.wanted = flags.DEFINE_enum(
        "distributed", "auto", ("auto", "true", "false"),
        "Start JAX's multi-process runtime (auto: when a coordinator is given, or on a "
        "multi-host TPU pod or a SLURM job of several tasks).")
    self.coordinator = flags.DEFINE_string(
        "coordinator_address", None, "host:port of process 0's coordinator (default: "
        "JAX_COORDINATOR_ADDRESS, or what the cluster says on TPU pods and SLURM).")
    self.num_processes = flags.DEFINE_integer(
        "num_processes", None,
        "Processes in the run (default: JAX_NUM_PROCESSES, or the cluster's).")
    self.process_id = flags.DEFINE_integer(
        "process_id", None, "This process's index (default: JAX_PROCESS_ID, or the cluster's).")

  def settings(self, environ=os.environ) -> dict | None:
    """jax.distributed.initialize's arguments for this process, or None for a single one."""
    def pick(flag, var, kind):
      if flag.value is not None:
        return flag.value
      return kind(environ[var]) if var in environ else None
    args = {"coordinator_address": pick(self.coordinator, "JAX_COORDINATOR_ADDRESS", str),
            "num_processes": pick(self.num_processes, "JAX_NUM_PROCESSES", int),
            "process_id": pick(self.process_id, "JAX_PROCESS_ID", int)}
    on_cluster = ("," in environ.get("TPU_WORKER_HOSTNAMES", "")
                  or int(environ.get("SLURM_NTASKS", "1")) > 1)
    wanted = {"true": True, "false": False}.get(
        self.wanted.value, args["coordinator_address"] is not None or on_cluster)
    if not wanted or args["num_processes"] == 1:
      return None
    return args

  def start(self) -> None:
    """jax.distributed.initialize where settings() asks for it, with CPU collectives
    (gloo) where the processes compute on the CPU: XLA's CPU backend has no
    cross-process collectives of its own."""
    args = self.settings()
    if args is None:
      return
    import jax  # not at the top: main re-executes itself before JAX starts (host/hugepages.py)
    if hugepages.cpu_only():
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)


def _guarded(main, argv):
  _quiet()
  try:
    return main(argv)
  except Exception as e:
    if environment_cause(e) is None and not isinstance(e, extras.MissingExtra):
      raise  # not the environment and not caught as bad input: a bug, with its traceback
    sys.exit(failed(e))


def run(main, flags_parser=parse_flags) -> None:
  """absl.app.run(main) with the parser above; a failure of the environment, or a missing
  optional extra, that `main` does not catch exits 1 in one line."""
  cpu_when_no_accelerator()
  app.run(lambda argv: _guarded(main, argv), flags_parser=flags_parser)
