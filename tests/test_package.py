"""The package stands alone: no torch behind `import bov_jax`, no benchmark code, no module
over one idea's length, no path hacks, no citations of documents outside the repository."""
import os
import pathlib
import re
import subprocess
import sys

from tests import helpers

ROOT = pathlib.Path(helpers.ROOT)
LIBRARY = sorted((ROOT / "bov_jax").rglob("*.py"))


def test_importing_every_module_imports_no_torch():
  modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in LIBRARY]
  code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
          + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


def test_modules_hold_one_idea_each():
  long = {str(p.relative_to(ROOT)): n for p in LIBRARY
          if (n := len(p.read_text().splitlines())) > 400}
  assert not long, long
  for p in LIBRARY:  # benchmarks and their profilers live in benchmarks/; a training
    if p.name != "profiler.py":  # run's trace (log.profile_steps) is profiler.py's
      assert not re.search(r"jax\.profiler|perf_counter\(\).*\bbench", p.read_text()), p


def test_no_path_hacks_and_no_outside_citations():
  for d in ("bov_jax", "configs", "tests"):
    for p in (ROOT / d).rglob("*.py"):
      text = p.read_text()
      if p.resolve() != pathlib.Path(__file__).resolve():  # the one file that names it
        assert "sys.path" not in text, p
      if d != "tests":
        assert "SPEC" not in text, p


def test_the_training_loop_reads_top_to_bottom():
  """train.py: no function over 40 lines, and every attribute of the loop is first set
  in its set-up (`__init__`), none later."""
  import ast
  tree = ast.parse((ROOT / "bov_jax" / "train.py").read_text())
  funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
  long = {f.name: f.end_lineno - f.lineno + 1 for f in funcs if f.end_lineno - f.lineno + 1 > 40}
  assert not long, long
  (loop,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Loop"]

  def assigned(fn):  # names bound as `self.NAME = ...` (also in tuples)
    out = set()
    for node in ast.walk(fn):
      if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
          for t in target.elts if isinstance(target, ast.Tuple) else [target]:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"):
              out.add(t.attr)
    return out
  methods = {f.name: f for f in loop.body if isinstance(f, ast.FunctionDef)}
  setup = assigned(methods["__init__"])
  later = {name: assigned(f) - setup for name, f in methods.items() if name != "__init__"}
  assert not any(later.values()), later


def _imports(path: pathlib.Path) -> set[str]:
  """The package's modules that `path` imports, at its top or inside a function alike."""
  import ast
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bov_jax"):
      for alias in node.names:  # `from bov_jax import x` names a module; `from bov_jax.m import y` m
        sub = f"{node.module}.{alias.name}"
        out.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).exists() else node.module)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith("bov_jax."))
  return out


def test_the_package_imports_no_circle():
  """No module reaches itself through the package's imports, counting those inside
  functions, which only hide a circle."""
  modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in LIBRARY}
  graph = {m: {d for d in _imports(p) if d in modules and d != m} for m, p in modules.items()}
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
