"""What every command shares: exit codes by cause (1 the environment, 2 the input), each
failure in one `error:` line, and a console kept to the command's own lines."""
import errno
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from bov_jax import cli
from bov_jax.data import corpus
from bov_jax.host import hugepages
from bov_jax.store import rundir
from tests import helpers
from tests.conftest import ROOT
from tests.helpers import command
from tests.helpers import command_env


class _FromGcsfs(Exception):
  """Stands for gcsfs's own errors (gcsfs.retry.HttpError): judged by their module."""


_FromGcsfs.__module__ = "gcsfs.retry"


def _wrapped(outer, inner):
  try:
    try:
      raise inner
    except Exception as e:
      raise outer from e
  except Exception as e:
    return e


@pytest.mark.parametrize("error, code", [
    (OSError(errno.ENOSPC, "No space left on device"), 1),
    (ValueError("RESOURCE_EXHAUSTED: Error writing local file \"x/_sharding\": No space left"), 1),
    (ValueError("UNAVAILABLE: GCS bucket unreachable"), 1),
    (ConnectionRefusedError(111, "Connect call failed"), 1),
    (_FromGcsfs("503 Service Unavailable"), 1),
    (_wrapped(RuntimeError("orbax: save failed"), PermissionError(13, "Permission denied")), 1),
    (MemoryError(), 1),
    (corpus.DataError("data.corpus: x.parquet row group 3 cannot be read"), 2),
    (_wrapped(corpus.DataError("data.corpus: x row group 3"), OSError("Corrupt snappy")), 2),
    (FileNotFoundError(2, "No such file or directory", "/nope"), 2),
    (rundir.RunDirError("--workdir=x is a file; expected a directory"), 2),
    (ValueError("optim.matrix_lr=-1: expected a number >= 0"), 2)])
def test_a_failure_is_the_environments_or_the_inputs(error, code, capsys):
  assert cli.failed(error) == code
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ")
  assert ("not the input" in err) == (code == 1)


def test_the_environments_cause_is_in_the_one_line(capsys):
  e = _wrapped(RuntimeError("checkpoint 20 was not written"),
               OSError(errno.ENOSPC, "No space left on device"))
  assert cli.failed(e) == 1
  assert capsys.readouterr().err.startswith(
      "error: checkpoint 20 was not written: OSError: [Errno 28] No space left on device (")


def _command(module, *args, env=None, timeout=300):
  """A command as a user runs it: no JAX_PLATFORMS (on a host without an accelerator the
  command picks the CPU itself, and libtpu stays silent), one device."""
  return command(module, *args, env=env or _env(), timeout=timeout)


def _env(**extra):
  return command_env(1, JAX_PLATFORMS=None, **extra)


@pytest.mark.slow
@pytest.mark.skipif(not hugepages.cpu_only({}), reason="an accelerator here: JAX starts on it")
def test_commands_print_only_their_own_lines(tiny_run, tmp_path):
  """export, report, convert and lm_eval print what they did and nothing of libtpu's
  start-up or the libraries' INFO logs; export lists every file it wrote."""
  out = _command("export", f"--workdir={tiny_run}", f"--out={tmp_path / 'folder'}")
  assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
  files = json.loads(out.stdout)["files"]
  assert sorted(os.path.basename(f) for f in files) == sorted(os.listdir(tmp_path / "folder"))
  out = _command("report", tiny_run, "--coeffs")
  assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
  dims = dict(sequence_len=640, vocab_size=100, n_layer=6, n_head=4, n_kv_head=2, n_embd=64,
              window_pattern="SSSL")
  np.savez(tmp_path / "model_000005.npz",
           **helpers.random_reference_state_dict("gpt_base_v_from_x0_learn", dims))
  (tmp_path / "meta_000005.json").write_text(json.dumps(
      {"model_config": dims, "user_config": {"model_type": "gpt_base_v_from_x0_learn"}}))
  out = _command("convert", f"--checkpoint={tmp_path}/model_000005.npz",
                 f"--meta={tmp_path}/meta_000005.json", f"--workdir={tmp_path}/converted")
  assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
  pytest.importorskip("lm_eval", reason="lm_eval is the optional eval extra: pip install '.[eval]'")
  out = _command("lm_eval", f"--workdir={tiny_run}", "--tasks=bov_tiny_ppl", "--limit=2",
                 f"--include_path={ROOT}/tests/data/lm_eval", f"--output={tmp_path}/r.json",
                 env=_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                          HF_HOME=str(tmp_path / "hf")))
  assert out.returncode == 0, out.stderr[-3000:]
  assert not [line for line in out.stderr.splitlines() if "libtpu" in line or "TPU" in line
              or line[:1] in "IE" and line[1:5].isdigit()], out.stderr[-3000:]


@pytest.fixture
def small_disk(tmp_path):
  """A 3 MiB file system (tmpfs), where the test may mount one."""
  mount = tmp_path / "disk"
  mount.mkdir()
  if os.geteuid() != 0 or not shutil.which("mount"):
    pytest.skip("a full disk needs a tmpfs mount: run the tests as root")
  made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                        capture_output=True, text=True)
  if made.returncode:
    pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
  yield mount
  subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_exits_1_naming_it(small_disk, tiny_run):
  """A run whose disk fills stops with exit 1 and one line naming the full disk (no
  half-written checkpoint left under its final name); so does an export into it."""
  wd = small_disk / "run"
  out = _command("main", f"--workdir={wd}", "--config=configs/tiny.py", *helpers.TINY_RUN,
                 "--config.data.tokenizer_chars=200000", "--config.train.num_iterations=30",
                 "--config.train.checkpoint_every=10", "--config.train.sample_tokens=0")
  assert out.returncode == 1, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "no space left on device" in lines[0].lower(), lines
  assert "not the input" in lines[0]
  assert all(p.name.isdigit() for p in (wd / "checkpoints").iterdir())
  with open(small_disk / "filler", "wb") as f:  # whatever room the run left, taken
    try:
      while True:
        f.write(b"\0" * 65536)
        f.flush()
    except OSError:
      pass
  out = _command("export", f"--workdir={tiny_run}", f"--out={small_disk / 'folder'}")
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 1 and len(lines) == 1 and "No space left" in lines[0], lines


@pytest.mark.slow
def test_a_lost_bucket_exits_1_naming_the_connection(tmp_path):
  """A bucket that cannot be reached (nothing listens where the emulator was) is the
  environment's failure: exit 1, one line with the connection's error."""
  dead = "http://127.0.0.1:9"  # the discard port: connections are refused
  out = _command("main", "--workdir=gs://bov/run", "--config=configs/tiny.py", *helpers.TINY_RUN,
                 env=_env(STORAGE_EMULATOR_HOST=dead, TENSORSTORE_GCS_HTTP_URL=dead,
                          GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"))
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
  assert "Cannot connect to host 127.0.0.1:9" in lines[0] and "not the input" in lines[0]
