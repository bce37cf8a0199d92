"""Optional dependencies (pyproject.toml's extras): a command that needs one it does not
find says which `pip install` brings it, in one line, and exits 1 (no traceback)."""

from __future__ import annotations

import importlib

EXIT = 1  # the command could not do its work; 2 stays "bad input"


class MissingExtra(ImportError):
  """An optional dependency is not installed; the message is the line to print."""


def require(module: str, extra: str, needed_for: str):
  """`module`, imported; or MissingExtra naming the extra that installs it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise MissingExtra(f"{needed_for} needs {module.split('.')[0]}, which is not installed: "
                       f"pip install '.[{extra}]' (or pip install 'bov_jax[{extra}]')") from e
