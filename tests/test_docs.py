"""What the README, the guides and the code cite exists: every repository path, every
`python -m` module (and, in the whole suite, each answers `--help`)."""
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import command_env

REPO = pathlib.Path(ROOT)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
CODE = [p for d in ("bov_jax", "benchmarks", "configs", "tests", "launch", "scripts")
        for p in sorted((REPO / d).rglob("*")) if p.suffix in (".py", ".sh", ".yaml")]
TEXTS = DOCS + CODE + [REPO / ".ci" / "run", REPO / "pyproject.toml"]
TOP = {"bov_jax", "benchmarks", "configs", "docs", "tests", "launch", "scripts", ".ci"}
FOLDERS = {p.name for p in (REPO / "bov_jax").iterdir() if (p / "__init__.py").exists()}
PATH = re.compile(r"(?<![\w./~-])((?:[\w.-]+/)+[\w-]+\.(?:py|md|sh|yaml|toml|png|txt|jsonl?))\b")
# Files of other projects that the code and docs cite by name (the reference's, MaxText's).
OUTSIDE = {"core_eval.py", "train_compile.py", "optim.py", "gpt.py", "base_train.py",
           "tok_train.py", "gradient_accumulation.py", "engine.py", "checkpoint_manager.py",
           "dataloader.py", "dataset.py", "loss_eval.py", "tokenizer.py"}
# The reference's own files, cited by their paths in its repository.
REFERENCE_PATHS = {"scripts/base_train.py", "scripts/tok_train.py", "configs/core.yaml"}
BARE = re.compile(r"`([\w]+\.py)`")
MODULE = re.compile(r"python -m ((?:bov_jax|benchmarks)(?:\.[a-z_]+)+)(?![\w.\\<])")


def _cited_paths():
  for f in TEXTS:
    for n, line in enumerate(f.read_text().splitlines(), 1):
      for path in PATH.findall(line):
        first = path.split("/")[0]
        if first in TOP or first in FOLDERS:
          yield f"{f.relative_to(REPO)}:{n}", path
      for name in BARE.findall(line):
        yield f"{f.relative_to(REPO)}:{n}", name


def _documented_modules() -> set[str]:
  return {m for f in TEXTS for m in MODULE.findall(f.read_text())}


def test_every_cited_repository_path_exists():
  names = {p.name for p in REPO.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
  missing = []
  for where, path in _cited_paths():
    if "/" not in path:
      ok = path in names or path in OUTSIDE
    else:
      placeholder = any(part.isupper() for part in re.split(r"[/.]", path))  # configs/NAME.py
      ok = (placeholder or path in REFERENCE_PATHS or (REPO / path).exists() or (REPO / "bov_jax" / path).exists())
    if not ok:
      missing.append(f"{where}: {path}")
  assert not missing, missing


def test_every_documented_module_exists():
  modules = _documented_modules()
  assert {"bov_jax.main", "bov_jax.export", "benchmarks.pods"} <= modules
  missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
  assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(_documented_modules()))
def test_every_documented_command_answers_help(module):
  """absl's --help prints the flags and exits 1; a module that fails to import prints a
  traceback instead."""
  out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                       text=True, cwd=REPO, env=command_env(1), timeout=300)
  assert out.returncode in (0, 1) and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert "flags:" in out.stdout or "usage:" in out.stdout.lower(), out.stdout[-2000:]
