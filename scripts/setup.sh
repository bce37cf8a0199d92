#!/usr/bin/env bash
# Creates (or refreshes) .venv with this checkout installed editable, tests included:
# pip install -e '.[dev]'. Idempotent: reinstalls only when pyproject.toml or
# requirements.txt changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.install.sha256
want="$(cat pyproject.toml requirements.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
