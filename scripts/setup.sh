#!/usr/bin/env bash
# Creates (or refreshes) .venv with this checkout installed editable, tests included:
# pip install -e '.[dev]'. Idempotent: reinstalls only when pyproject.toml or
# requirements.txt changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON, else the first Python >= 3.12 found (JAX 0.11 and newer need it),
# pyenv's installed versions included where the one on PATH is older.
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
find_python() {
  local c
  for c in ${PYTHON:-} python3 python3.12 python3.13 python3.14 \
           "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.1[2-9]*/bin/python3; do
    if [ -n "$c" ] && new_enough "$c"; then echo "$c"; return; fi
  done
  echo "setup.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
  exit 2
}
if [ ! -x .venv/bin/python ] || ! new_enough .venv/bin/python; then
  PY="$(find_python)"
  rm -rf .venv
  "$PY" -m venv .venv
fi
stamp=.venv/.install.sha256
want="$(cat pyproject.toml requirements.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
