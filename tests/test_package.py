"""The package stands alone: no torch behind `import bov_jax`, no benchmark code, no path
hacks, no citations of documents outside the repository, no circles between its parts."""
import os
import pathlib
import re
import subprocess
import sys

from tests.conftest import ROOT

REPO = pathlib.Path(ROOT)
# The package's modules: files of folders with an __init__.py (interop/hf_code/ is data, the
# PyTorch model an exported folder carries, read by transformers and never imported here).
LIBRARY = sorted(p for p in (REPO / "bov_jax").rglob("*.py") if (p.parent / "__init__.py").exists())
HF_CODE = sorted((REPO / "bov_jax" / "interop" / "hf_code").glob("*.py"))


def test_importing_every_module_imports_no_torch():
  """The library and `main` (each command defines its flags when imported, so they are
  imported one per process by the tests that run them), nor a run's TensorBoard writer
  (tensorboardX imports torch where it is installed, as it is here)."""
  modules = [_name(p) for p in LIBRARY if not _is_command(p) or p.stem == "main"]
  log = "{'tensorboard': True, 'wandb_project': '', 'wandb_entity': ''}"
  code = ("import sys, tempfile, ml_collections\n" + "".join(f"import {m}\n" for m in modules)
          + "w = bov_jax.store.metrics.Writer(tempfile.mkdtemp(), 0, "
          + f"ml_collections.ConfigDict({log}), {{}})\n"
          + "w.write({'step': 1, 'train_loss': 1.0}); w.close()\n"
          + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_exported_model_code_is_data_apart_from_the_library():
  """hf_code/ imports nothing of bov_jax (it runs where bov_jax is not installed), and no
  module of the library imports it (export copies its files)."""
  assert [p.name for p in HF_CODE] == ["configuration_bov_gpt.py", "modeling_bov_gpt.py"]
  for p in HF_CODE:
    assert not {"bov_jax", "jax", "flax"} & _top_imports(p), p
  for p in LIBRARY:
    assert "hf_code import" not in p.read_text() and "hf_code." not in p.read_text(), p


def test_timing_lives_in_benchmarks():
  """Benchmarks and their profilers live in benchmarks/; a training run's trace
  (log.profile_steps) is profiler.py's."""
  for p in LIBRARY:
    if p.name != "profiler.py":
      assert not re.search(r"jax\.profiler|perf_counter\(\).*\bbench", p.read_text()), p


def test_no_path_hacks_and_no_outside_citations():
  for d in ("bov_jax", "configs", "tests"):
    for p in (REPO / d).rglob("*.py"):
      text = p.read_text()
      if p.resolve() != pathlib.Path(__file__).resolve():  # the one file that names it
        assert "sys.path" not in text, p
      if d != "tests":
        assert "SPEC" not in text, p


def _name(p: pathlib.Path) -> str:
  return ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _is_command(p: pathlib.Path) -> bool:
  """A command: a module of the package's top (but cli.py, what they share)."""
  return p.parent == REPO / "bov_jax" and p.stem not in ("__init__", "cli")


def _folder(module: str) -> str:
  """The folder a module of the package is in ("" for the package's top)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 2 or (REPO / "bov_jax" / parts[-1]).is_dir() else ""


MODULES = {_name(p): p for p in LIBRARY}


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
  """(module of the package, line, inside a function) for every import of `path`."""
  import ast
  tree = ast.parse(path.read_text())
  out = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda))
      names = []
      if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("bov_jax"):
        for a in child.names:  # `from bov_jax.x import m` names the module m, or names in x
          sub = f"{child.module}.{a.name}"
          names.append(sub if sub in MODULES else child.module)
      elif isinstance(child, ast.Import):
        names = [a.name for a in child.names if a.name.startswith("bov_jax.")]
      out.extend((n, child.lineno, in_function) for n in names if n in MODULES)
      visit(child, inner)

  visit(tree, False)
  return out


def _top_imports(path: pathlib.Path) -> set[str]:
  """The top-level names of what `path` imports at module level (a try: included)."""
  import ast
  out = set()
  for node in ast.parse(path.read_text()).body:
    for n in ast.walk(node) if isinstance(node, (ast.Try, ast.If)) else [node]:
      if isinstance(n, ast.Import):
        out.update(a.name.split(".")[0] for a in n.names)
      elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
        out.add(n.module.split(".")[0])
  return out


def _optional_extras() -> set[str]:
  """The import names of pyproject.toml's optional extras (not the JAX backends' or dev's)."""
  import tomllib
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  return {re.split(r"[=<>\[; ]", d)[0].replace("-", "_") for name, deps in extras.items()
          if name not in ("tpu", "cuda", "dev") for d in deps}


def test_the_package_imports_no_circle_and_nothing_inside_a_function():
  """No module reaches itself through the package's imports (counting those inside
  functions, which only hide a circle), and none imports one of the package's modules
  inside a function, but a command (it sets up JAX before the library loads) or to reach
  a module that needs an optional extra."""
  graph = {m: {d for d, _, _ in _imports(p) if d != m} for m, p in MODULES.items()}
  state, circles = {}, []

  def visit(m, trail):
    state[m] = "open"
    for d in sorted(graph[m]):
      if state.get(d) == "open":
        circles.append(trail[trail.index(d):] + [d])
      elif d not in state:
        visit(d, trail + [d])
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not circles, [" -> ".join(c) for c in circles]
  extras = _optional_extras()
  assert {"torch", "lm_eval", "wandb", "matplotlib"} <= extras
  hidden = [f"{p.relative_to(REPO)}:{line} imports {d}" for m, p in MODULES.items()
            for d, line, inside in _imports(p)
            if inside and not _is_command(p) and not _top_imports(MODULES[d]) & extras]
  assert not hidden, hidden


def _declared_imports() -> dict[str, set[str]]:
  """{folder: the folders its __init__.py says it may import}, from its `Imports:` line."""
  folders = {p.parent.name for p in LIBRARY if p.name == "__init__.py" and p.parent.name != "bov_jax"}
  out = {}
  for f in folders:
    doc = (REPO / "bov_jax" / f / "__init__.py").read_text()
    line = re.search(r"^Imports: (.*)$", doc, re.M)
    assert line, f"bov_jax/{f}/__init__.py says nothing of what it may import"
    out[f] = {w for w in re.findall(r"\w+", line.group(1)) if w in folders}
  return out


def test_each_folder_imports_only_the_folders_below_it():
  """Every folder's __init__.py says what it holds and which folders it may import; those
  form no circle (each folder sits above the ones it imports) and the code keeps to them:
  no arrow back up. Commands sit above everything."""
  declared = _declared_imports()
  order, seen = [], set()

  def place(f, trail):
    assert f not in trail, f"the folders' Imports: lines go round: {' -> '.join(trail + [f])}"
    if f not in seen:
      for d in sorted(declared[f]):
        place(d, trail + [f])
      seen.add(f)
      order.append(f)

  for f in sorted(declared):
    place(f, [])
  wrong = []
  for m, p in MODULES.items():
    here = _folder(m)
    if _is_command(p) or not here:
      continue
    for d, line, _ in _imports(p):
      there = _folder(d)
      if there != here and there not in declared[here]:
        wrong.append(f"{p.relative_to(REPO)}:{line} imports {d} ({there or 'the top'})")
  assert not wrong, wrong
  assert {_folder(m) for m, p in MODULES.items() if _folder(m)} == set(declared)
