"""The package stands alone: no torch behind `import bov_jax`, no benchmark code, no module
over one idea's length, no path hacks, no citations of documents outside the repository."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
  for p in LIBRARY:  # benchmarks and profilers live in benchmarks/
    assert not re.search(r"jax\.profiler|perf_counter\(\).*\bbench", p.read_text()), p


def test_no_path_hacks_and_no_outside_citations():
  hack = "sys." + "path"  # spelled apart, so that `grep -rn` over the tree finds none
  for d in ("bov_jax", "configs", "tests"):
    for p in (ROOT / d).rglob("*.py"):
      text = p.read_text()
      assert hack not in text, p
      if d != "tests":
        assert "SPEC" not in text, p
