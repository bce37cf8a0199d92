"""What every command shares: its flags parsed so that bad input exits 2 in one line.

`run(main)` is `absl.app.run` with this parser. absl's own reports a value of the wrong
type as a fatal error with exit 1, and ml_collections an unknown `--config.FIELD` as a
traceback; both are bad input, named here by the flag as written, with the setting's
likely intended name where ml_collections suggests one.
"""

from __future__ import annotations

import re
import sys

from absl import app
from absl import flags

BAD_INPUT = 2  # the README's exit codes: 0 done, 1 the run (or its environment) failed


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


def run(main) -> None:
  app.run(main, flags_parser=parse_flags)
