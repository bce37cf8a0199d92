"""What the tests share: small configs, the one runner of the commands they start, and an
independent numpy oracle of the reference's forward pass."""
from __future__ import annotations

import glob
import json
import os
import socket
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from bov_jax.evaluation import core
from bov_jax.model import gpt as model_lib
from bov_jax.model import initialize
from bov_jax.model import params as params_lib
from bov_jax.parallel import sharding
from bov_jax.run import spec as spec_lib
from bov_jax.settings import config as config_lib
from bov_jax.store import safetensors
from bov_jax.training import step as step_lib
from tests.conftest import ROOT


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a run a test starts: `devices` simulated CPU devices, compiled as the
  session compiles (conftest's other flags)."""
  rest = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join([f"--xla_force_host_platform_device_count={devices}", *rest])


# The shapes of the runs the tests start (python -m bov_jax.main, sweep, the benchmarks),
# all one tiny model and batch, so the session's compilation cache (conftest) compiles
# their init, step, eval and sampling once. Two layers: the second is a bank layer.
TINY_RUN = ["--config.model.n_layer=2", "--config.model.n_embd=64",
            "--config.model.sequence_len=64", "--config.model.short_window=32",
            "--config.model.vocab_size=512", "--config.train.device_batch_size=8",
            "--config.train.batch_tokens=1024", "--config.train.eval_tokens=2048",
            "--config.data.tokenizer_chars=2000000"]


def slow_except(params, fast):
  """`params` for pytest.mark.parametrize, those outside `fast` marked slow: a sweep whose
  few representative cases stay in the fast subset and whose rest runs in the whole suite."""
  return [p if p in fast else pytest.param(p, marks=pytest.mark.slow) for p in params]


def small_config(preset: str = "gpt_base_v_from_value_emb_learn", **model):
  c = config_lib.base_config()
  c.model.update(dict(n_layer=6, n_embd=64, n_head=4, n_kv_head=2, sequence_len=64,
                      vocab_size=100, window_pattern="SSSL", short_window=8))
  c.model.update(model)
  c.model.value.preset = preset
  c.train.num_iterations = 10
  c.train.batch_tokens = 512  # 8 rows of 64: one per device of the tests' 8
  c.train.device_batch_size = 4
  return c


def run_spec(cfg, backend=None, n_devices=None):
  return spec_lib.resolve(cfg, backend, n_devices)


def model_spec(cfg):
  return spec_lib.model_of(cfg)


def init_model(cfg, key):
  """An initialised model of a config (resolved, then initialize.init)."""
  return initialize.init(model_spec(cfg), key)


def random_model(cfg, seed=0, scale=0.1, backend=None):
  """A model of a config's structure whose every parameter is scale * N(0, 1), drawn by
  numpy: for tests of the forward pass, which need every path live (init leaves the
  output projections at zero) but not the initialisation, which has its own tests and
  would cost each of these a compile."""
  graphdef, state = nnx.split(model_lib.abstract(spec_lib.model_of(cfg, backend)))
  rng = np.random.default_rng(seed)
  leaves, tree = jax.tree.flatten(state)
  leaves = [jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype) for x in leaves]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


# --- a numpy transcription of the reference's forward pass, on its parameter names ----
# Written independently of bov_jax (its own variant table, float64 math), so a
# formula or a name mapping that drifts in the package fails the comparison.

REF_VARIANTS = {  # model_type -> (source, combine, learned, layers, shared)
    "gpt_base": (None, None, False, None, False),
    "gpt_base_v_scale_learn": ("self", "scale", True, "third", False),
    "gpt_base_v_from_v1_every_layer": ("v1", "replace", False, "all", False),
    "gpt_base_v_from_v1_learn_every2": ("v1", "replace", True, "every2", False),
    "gpt_base_v_from_v1": ("v1", "replace", False, "third", False),
    "gpt_base_v_from_v1_learn": ("v1", "replace", True, "third", False),
    "gpt_base_v_from_x0_learn_every2": ("x0", "replace", True, "every2", False),
    "gpt_base_v_from_x0": ("x0", "replace", False, "third", False),
    "gpt_base_v_from_x0_learn": ("x0", "replace", True, "third", False),
    "gpt_base_add_init_v": ("v1", "add", False, "third", False),
    "gpt_base_add_init_v_learn": ("v1", "add", True, "third", False),
    "gpt_base_add_init_res_v": ("x0", "add", False, "third", False),
    "gpt_base_add_init_res_v_learn": ("x0", "add", True, "third", False),
    "gpt_base_v_from_value_emb_learn": ("emb", "replace", True, "third", False),
    "gpt_base_v_from_value_emb": ("emb", "replace", False, "third", False),
    "gpt_base_v_from_value_emb_learn_shared": ("emb", "replace", True, "third", True),
    "gpt_base_v_from_value_emb_learn_every_layer": ("emb", "replace", True, "all", False),
    "gpt_base_v_from_value_emb_learn_every2": ("emb", "replace", True, "every2", False),
    "gpt_base_v_from_value_emb_learn_second_half": ("emb", "replace", True, "half", False),
    "gpt_base_v_from_value_emb_learn_last_two_thirds": ("emb", "replace", True, "twothirds", False),
    "gpt_base_add_init_value_emb": ("emb", "add", False, "third", False),
    "gpt_base_add_init_value_emb_learn": ("emb", "add", True, "third", False),
    "gpt_base_add_init_value_emb_nanogpt": ("emb", "gated", True, "third", False),
    "gpt_base_add_init_value_emb_nanogpt_every2": ("emb", "gated", True, "every2", False),
}


def ref_targets(model_type, L):
  source, _, _, layers, _ = REF_VARIANTS[model_type]
  if source is None:
    return []
  rule = {"third": lambda i: i >= 2 * L // 3, "all": lambda i: True,
          "every2": lambda i: i % 2 == (L - 1) % 2, "half": lambda i: i >= L // 2,
          "twothirds": lambda i: i >= L // 3}[layers]
  return [i for i in range(L) if rule(i) and not (source == "v1" and i == 0)]


def random_reference_state_dict(model_type, dims, seed=0):
  """Random weights in the reference layout ([out, in]), dead c_v included."""
  rng = np.random.default_rng(seed)
  d, H, K, L = dims["n_embd"], dims["n_head"], dims["n_kv_head"], dims["n_layer"]
  dh = d // H
  Vp = -(-dims["vocab_size"] // 64) * 64
  r = lambda *shape, s=1.0: (s * rng.standard_normal(shape)).astype(np.float32)
  sd = {"transformer.wte.weight": r(Vp, d), "lm_head.weight": r(Vp, d, s=0.3),
        "smear_gate.weight": r(1, 24, s=0.5), "smear_lambda": np.array([0.7], np.float32)}
  for i in range(L):
    h = f"transformer.h.{i}"
    sd[f"{h}.attn.c_q.weight"] = r(H * dh, d, s=0.3)
    sd[f"{h}.attn.c_k.weight"] = r(K * dh, d, s=0.3)
    sd[f"{h}.attn.c_v.weight"] = r(K * dh, d, s=0.3)
    sd[f"{h}.attn.c_proj.weight"] = r(d, d, s=0.1)
    sd[f"{h}.mlp.c_fc.weight"] = r(4 * d, d, s=0.2)
    sd[f"{h}.mlp.c_proj.weight"] = r(d, 4 * d, s=0.05)
    sd[f"{h}.attn.gamma_v"] = np.array([1.3 + 0.1 * i], np.float32)
    sd[f"{h}.attn.alpha_v"] = np.array([0.8 - 0.05 * i], np.float32)
    sd[f"{h}.attn.beta_v"] = np.array([0.4 + 0.1 * i], np.float32)
    sd[f"{h}.attn.ve_gate.weight"] = r(K, 12, s=0.5)
  targets = ref_targets(model_type, L)
  if REF_VARIANTS[model_type][0] == "emb":
    shared = r(Vp, K * dh)
    for i in targets:
      sd[f"value_embeds.{i}.weight"] = shared if REF_VARIANTS[model_type][4] else r(Vp, K * dh)
  return sd


def _rms(x):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.finfo(np.float32).eps)


def _rope(x, T):  # x [B, T, N, dh], half-split, base 100000
  dh = x.shape[-1]
  inv = 1.0 / (100000.0 ** (np.arange(0, dh, 2) / dh))
  ang = np.arange(T)[:, None] * inv[None]
  cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
  x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
  return np.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], -1)


def reference_logits(sd, model_type, dims, idx):
  """float64 forward pass of the reference's model on a reference state_dict."""
  sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
  d, H, K, L, T_ctx = (dims["n_embd"], dims["n_head"], dims["n_kv_head"], dims["n_layer"],
                       dims["sequence_len"])
  dh = d // H
  source, combine, learned, _, _ = REF_VARIANTS[model_type]
  targets = ref_targets(model_type, L)
  S = -(-(T_ctx // 4) // 128) * 128
  pattern = dims["window_pattern"]
  windows = [T_ctx if pattern[i % len(pattern)] == "L" else S for i in range(L)]
  windows[-1] = T_ctx
  B, T = idx.shape
  x = _rms(sd["transformer.wte.weight"][idx])
  gate = sd["smear_lambda"][0] / (1 + np.exp(-(x[:, 1:, :24] @ sd["smear_gate.weight"].T)))
  x = np.concatenate([x[:, :1], x[:, 1:] + gate * x[:, :-1]], axis=1)
  x0 = x
  v1 = None
  i_idx, j_idx = np.arange(T)[:, None], np.arange(T)[None, :]
  for i in range(L):
    h = f"transformer.h.{i}"
    xn = _rms(x)
    q = (xn @ sd[f"{h}.attn.c_q.weight"].T).reshape(B, T, H, dh)
    k = (xn @ sd[f"{h}.attn.c_k.weight"].T).reshape(B, T, K, dh)
    v = (xn @ sd[f"{h}.attn.c_v.weight"].T).reshape(B, T, K, dh)
    if i == 0:
      v1 = v
    if i in targets:
      if source == "x0":
        vt = (_rms(x0) @ sd[f"{h}.attn.c_v.weight"].T).reshape(B, T, K, dh)
      elif source == "v1":
        vt = v1
      elif source == "emb":
        vt = sd[f"value_embeds.{i}.weight"][idx].reshape(B, T, K, dh)
      gamma, alpha, beta = (sd[f"{h}.attn.{c}_v"][0] for c in ("gamma", "alpha", "beta"))
      if combine == "scale":
        v = gamma * v
      elif combine == "replace":
        v = gamma * vt if learned else vt
      elif combine == "add":
        v = alpha * v + beta * vt if learned else 0.5 * v + 0.5 * vt
      elif combine == "gated":
        g = 3.0 / (1 + np.exp(-(xn[..., :12] @ sd[f"{h}.attn.ve_gate.weight"].T)))
        v = v + g[..., None] * vt
    q = _rms(_rope(q, T)) * 1.2
    k = _rms(_rope(k, T)) * 1.2
    k = np.repeat(k, H // K, axis=2)
    v = np.repeat(v, H // K, axis=2)
    s = np.einsum("bthe,bshe->bhts", q, k) / np.sqrt(dh)
    visible = (i_idx - j_idx >= 0) & (i_idx - j_idx <= windows[i])
    s = np.where(visible[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = np.einsum("bhts,bshe->bthe", p, v).reshape(B, T, d)
    x = x + y @ sd[f"{h}.attn.c_proj.weight"].T
    x = x + np.maximum(_rms(x) @ sd[f"{h}.mlp.c_fc.weight"].T, 0) ** 2 @ sd[f"{h}.mlp.c_proj.weight"].T
  z = (_rms(x) @ sd["lm_head.weight"].T)[..., : dims["vocab_size"]]
  return 15.0 * np.tanh(z / 15.0)


def corrupt_row_group(path, group):
  """Flips bytes in the middle of a row group's column chunk (its compressed pages)."""
  import pyarrow.parquet as pq
  m = pq.ParquetFile(path).metadata.row_group(group).column(0)
  start = m.dictionary_page_offset or m.data_page_offset
  raw = bytearray(path.read_bytes())
  n = m.total_compressed_size
  for i in range(start + n // 3, start + n // 3 + n // 4):
    raw[i] ^= 0x5A
  path.write_bytes(bytes(raw))


def sgd_step_on_mesh_and_one_device(cfg, idx, shape):
  """One train step (plain SGD, lr 1: new params = params - grads) of the same random
  parameters (every one non-zero) on one device and on a mesh: ((params, out) one device,
  (params, out) mesh, the mesh's starting params)."""
  graphdef = nnx.graphdef(model_lib.abstract(model_spec(cfg)))
  tx = optax.sgd(1.0)
  step = step_lib.make_train_step(graphdef, tx)
  x, y = idx[..., :-1], idx[..., 1:]
  dev0 = jax.devices()[0]
  params = nnx.to_pure_dict(nnx.state(random_model(cfg, seed=9, scale=0.05)))
  p1 = jax.device_put(params, dev0)
  ref_params, _, ref_out = jax.jit(step)(p1, tx.init(p1), jax.device_put(x, dev0),
                                         jax.device_put(y, dev0))
  c = small_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = shape
  mesh = sharding.make_mesh(c.mesh)
  _, _, shardings = params_lib.abstract_params(model_spec(cfg), mesh)
  p8 = jax.device_put(params, shardings)
  bsh = sharding.batch_sharding(mesh, leading_dims=2)
  with jax.set_mesh(mesh):
    new_params, _, out = jax.jit(step, in_shardings=(shardings, None, bsh, bsh),
                                 out_shardings=(shardings, None, None))(
        p8, tx.init(p8), jax.device_put(x, bsh), jax.device_put(y, bsh))
  return (ref_params, ref_out), (new_params, out), p8


def read_events(logdir) -> dict:
  """{tag: [(step, value), ...]} from the TensorBoard event files in logdir (TFRecords of
  Event protos)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in sorted(glob.glob(f"{logdir}/events.out.tfevents.*")):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def write_authors_bundle(root, n_items=3):
  """A bundle with every task of the authors' list (tiny items in each format) and a
  core.yaml of its own that must be ignored."""
  import yaml
  tasks = yaml.safe_load(open(core.AUTHORS_TASKS))["icl_tasks"]
  rows = ["Eval Task,Task Category,Random baseline"]
  for t in tasks:
    path = root / "eval_data" / t["dataset_uri"]
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = t["icl_task_type"]
    items = [({"query": f"q{i} is", "choices": ["a", "b"], "gold": i % 2} if kind == "multiple_choice"
              else {"context_options": [f"c{i}", f"d{i}"], "continuation": "e", "gold": 0}
              if kind == "schema" else {"context": f"x{i}", "continuation": "y"})
             for i in range(max(n_items, 26))]  # 25 shots need 26 items
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    rows.append(f"{t['label']},c,{50.0 if kind != 'language_modeling' else 0.0}")
  (root / "eval_meta_data.csv").write_text("\n".join(rows) + "\n")
  (root / "core.yaml").write_text("icl_tasks:\n- label: copa\n  dataset_uri: "
                                  "commonsense_reasoning/copa.jsonl\n  num_fewshot: [7]\n"
                                  "  icl_task_type: multiple_choice\n")
  return tasks


def weights_dict():
  """A small nested parameter dict of mixed dtypes, as an exported folder holds."""
  rng = np.random.default_rng(0)
  return {"wte": rng.standard_normal((10, 4)).astype(ml_dtypes.bfloat16),
          "blocks": {0: {"attn": {"wq": rng.standard_normal((4, 4)).astype(np.float32)}},
                     1: {"attn": {"wq": rng.standard_normal((4, 4)).astype(np.float32)}}},
          "tables": {"layer_1": rng.standard_normal((10, 4)).astype(ml_dtypes.bfloat16)}}


def equal_bits(a: dict, b: dict):
  fa, fb = safetensors.tensor_names(a), safetensors.tensor_names(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    x, y = np.asarray(fa[k]), np.asarray(fb[k])
    assert x.dtype == y.dtype and x.shape == y.shape, k
    assert x.tobytes() == y.tobytes(), k


# --- the one runner of the commands the tests start -----------------------------------

def command_env(devices: int | None = None, **extra) -> dict:
  """The environment a test starts a command in: `devices` simulated CPU devices (default:
  the session's 8), compiled as the session compiles (xla_flags), output unbuffered;
  `extra` on top (None removes a variable: JAX_PLATFORMS=None runs it as a user does, the
  CPU picked by the command itself)."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if devices is not None:
    env["XLA_FLAGS"] = xla_flags(devices)
  for k, v in extra.items():
    if v is None:
      env.pop(k, None)
    else:
      env[k] = str(v)
  return env


def free_port() -> int:
  """A TCP port free on this host, for the coordinator of a multi-process command."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _argv(module: str, args) -> list[str]:
  return [sys.executable, "-m", module if "." in module else f"bov_jax.{module}",
          *map(str, args)]


def command(module: str, *args, devices: int | None = None, env=None, timeout: float = 600,
            input: str | None = None) -> subprocess.CompletedProcess:
  """`python -m bov_jax.<module> ARGS...` (or a dotted module, `benchmarks.train`) run from
  the repository root, its output captured as text."""
  return subprocess.run(_argv(module, args), capture_output=True, text=True, cwd=ROOT,
                        env=env or command_env(devices), timeout=timeout, input=input)


def start(module: str, *args, devices: int | None = None, env=None,
          **popen) -> subprocess.Popen:
  """The same command started, not waited for (for a test that signals or kills it)."""
  popen.setdefault("stdout", subprocess.PIPE)
  popen.setdefault("stderr", subprocess.STDOUT)
  return subprocess.Popen(_argv(module, args), text=True, cwd=ROOT,
                          env=env or command_env(devices), **popen)
