"""Checkpoint import from the reference: every variant's logits against a numpy oracle."""
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bov_jax.interop import nanochat as convert
from bov_jax.model import gpt as model_lib
from bov_jax.settings import values
from tests import helpers
from tests.helpers import command
from tests.helpers import model_spec

# sequence_len 640 gives the reference's short window 256; 300 tokens cross it.
DIMS = dict(sequence_len=640, vocab_size=100, n_layer=6, n_head=4, n_kv_head=2, n_embd=64,
            window_pattern="SSSL")


def _tokens(T=300, B=2, seed=1):
  return np.random.default_rng(seed).integers(0, DIMS["vocab_size"], (B, T)).astype(np.int32)


def test_every_reference_variant_is_a_preset():
  assert set(helpers.REF_VARIANTS) == set(values.PRESETS)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("model_type", sorted(helpers.REF_VARIANTS))
def test_logits_match_reference_formulas(model_type, scan):
  """Unrolled (the CPU's default) and with the layers run as scanned stages (the
  accelerators'), the same weights give the reference's logits."""
  sd = helpers.random_reference_state_dict(model_type, DIMS)
  model = convert.from_nanochat(sd, model_type, **DIMS)
  if scan:
    spec = dataclasses.replace(model.spec, scan=True)
    assert any(stage.scanned for stage in spec.stages)
    model = nnx.merge(nnx.graphdef(model_lib.abstract(spec)), nnx.state(model))
  idx = _tokens()
  got = np.asarray(model(jnp.asarray(idx)))
  assert got.dtype == np.float32 and got.shape == (2, 300, DIMS["vocab_size"])
  want = helpers.reference_logits(sd, model_type, DIMS, idx)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_windows_matter_in_this_comparison():
  """Guard: with all-full windows the oracle's logits change, so the test sees windows."""
  sd = helpers.random_reference_state_dict("gpt_base", DIMS)
  idx = _tokens()
  a = helpers.reference_logits(sd, "gpt_base", DIMS, idx)
  b = helpers.reference_logits(sd, "gpt_base", dict(DIMS, window_pattern="L"), idx)
  assert np.abs(a - b)[:, 258:].max() > 1e-3
  np.testing.assert_allclose(a[:, :257], b[:, :257], atol=1e-9)


def test_dead_value_matrix_is_dropped_and_not_owned():
  mt = "gpt_base_v_from_value_emb_learn"
  sd = helpers.random_reference_state_dict(mt, DIMS)
  assert "transformer.h.5.attn.c_v.weight" in sd
  model = convert.from_nanochat(sd, mt, **DIMS)
  assert model.blocks[5].attn.wv is None and model.blocks[3].attn.wv is not None


def test_missing_tensor_is_named():
  mt = "gpt_base_v_from_value_emb_learn"
  sd = helpers.random_reference_state_dict(mt, DIMS)
  del sd["value_embeds.4.weight"]
  with pytest.raises(convert.ConversionError, match=r"value_embeds\.4\.weight"):
    convert.from_nanochat(sd, mt, **DIMS)


def test_misshaped_tensor_is_named():
  sd = helpers.random_reference_state_dict("gpt_base", DIMS)
  sd["transformer.h.2.mlp.c_fc.weight"] = np.zeros((10, 64), np.float32)
  with pytest.raises(convert.ConversionError, match=r"transformer\.h\.2\.mlp\.c_fc\.weight"):
    convert.from_nanochat(sd, "gpt_base", **DIMS)


def test_shared_table_reads_one_tensor():
  mt = "gpt_base_v_from_value_emb_learn_shared"
  sd = helpers.random_reference_state_dict(mt, DIMS)
  model = convert.from_nanochat(sd, mt, **DIMS)
  assert list(model.tables.keys()) == ["shared"]
  np.testing.assert_array_equal(np.asarray(model.tables["shared"][...]),
                                sd["value_embeds.4.weight"])


def test_round_trip_to_reference_names():
  mt = "gpt_base_add_init_value_emb_nanogpt"
  sd = helpers.random_reference_state_dict(mt, DIMS)
  back = convert.to_nanochat(convert.from_nanochat(sd, mt, **DIMS))
  for k, v in back.items():
    np.testing.assert_array_equal(v, sd[k], err_msg=k)


@pytest.mark.slow
def test_convert_command_writes_a_loadable_checkpoint(tmp_path):
  from bov_jax.model import gpt as model_lib
  from bov_jax.store import checkpoint
  from bov_jax.store import rundir
  mt = "gpt_base_v_from_x0_learn"
  sd = helpers.random_reference_state_dict(mt, DIMS)
  np.savez(tmp_path / "model_000123.npz", **sd)
  meta = {"model_config": dict(DIMS), "user_config": {"model_type": mt}}
  (tmp_path / "meta_000123.json").write_text(json.dumps(meta))
  out = command("convert", f"--checkpoint={tmp_path}/model_000123.npz",
                f"--meta={tmp_path}/meta_000123.json", f"--workdir={tmp_path}/run", timeout=300)
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout.strip().splitlines()[-1])["checkpoint"].endswith("123")
  cfg = rundir.read_config(str(tmp_path / "run"))
  abstract = model_lib.abstract(model_spec(cfg))
  step, params, _, _, _ = checkpoint.Checkpoints(str(tmp_path / "run")).restore(
      nnx.to_pure_dict(nnx.state(abstract)))
  assert step == 123
  fresh = nnx.merge(nnx.graphdef(abstract), params)
  idx = _tokens(T=40)
  np.testing.assert_allclose(np.asarray(fresh(jnp.asarray(idx))),
                             helpers.reference_logits(sd, mt, DIMS, idx), atol=1e-4)


def test_convert_command_needs_a_model_type(tmp_path):
  (tmp_path / "meta.json").write_text(json.dumps({"model_config": DIMS}))
  np.savez(tmp_path / "m.npz", x=np.zeros(1))
  out = command("convert", f"--checkpoint={tmp_path}/m.npz",
                f"--meta={tmp_path}/meta.json", f"--workdir={tmp_path}/run", timeout=300)
  assert out.returncode == 2 and "--model_type" in out.stderr




@pytest.mark.slow
def test_convert_brings_the_reference_tokenizer_and_never_trains_one(tmp_path):
  """--tokenizer copies the authors' tokenizer.pkl into the run directory; a converted run
  without one is refused a freshly trained tokenizer (its weights need their own)."""
  import pickle

  from bov_jax.data import corpus
  from bov_jax.data import sources
  from bov_jax.data import tokenizer as tok_lib
  from tests.helpers import run_spec
  from tests.helpers import small_config
  dims = dict(DIMS, vocab_size=300)
  mt = "gpt_base"
  np.savez(tmp_path / "model_000007.npz", **helpers.random_reference_state_dict(mt, dims))
  (tmp_path / "meta.json").write_text(json.dumps({"model_config": dims, "model_type": mt}))
  ref = tok_lib.train(tok_lib.training_texts(corpus.embedded_documents()[:400], 300_000), 300)
  (tmp_path / "ref_tok").mkdir()
  (tmp_path / "ref_tok" / "tokenizer.pkl").write_bytes(pickle.dumps(ref.enc))
  cmd = ["convert", f"--checkpoint={tmp_path}/model_000007.npz", f"--meta={tmp_path}/meta.json"]
  out = command(*cmd, f"--workdir={tmp_path}/run", f"--tokenizer={tmp_path}/ref_tok", timeout=300)
  assert out.returncode == 0, out.stderr
  got = tok_lib.load(str(tmp_path / "run" / "tokenizer"))
  assert got.encode("def f(x): return x") == ref.encode("def f(x): return x")
  spec = run_spec(small_config("gpt_base", vocab_size=300))
  assert sources.tokenizer(spec, str(tmp_path / "run")).vocab_size == 300
  out = command(*cmd, f"--workdir={tmp_path}/bare", timeout=300)
  assert out.returncode == 0, out.stderr
  train, _ = sources.documents(spec)
  with pytest.raises(tok_lib.TokenizerError, match=r"has no tokenizer/tokenizer\.pkl.*"
                     r"--config\.data\.tokenizer=PATH"):
    sources.tokenizer(spec, str(tmp_path / "bare"), train)  # would train: refused
  (tmp_path / "small").mkdir()
  small = tok_lib.train(tok_lib.training_texts(corpus.embedded_documents()[:400], 300_000), 280)
  (tmp_path / "small" / "tokenizer.pkl").write_bytes(pickle.dumps(small.enc))
  bad = command(*cmd, f"--workdir={tmp_path}/r2", f"--tokenizer={tmp_path}/small", timeout=300)
  assert bad.returncode == 2 and "has 280 tokens but model.vocab_size=300" in bad.stderr
