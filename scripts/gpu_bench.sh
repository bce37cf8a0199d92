#!/usr/bin/env bash
# The GPU runs of docs/performance.md ("One H200, the d12 configs") in one go:
#   bash scripts/gpu_bench.sh [RUN ...]   (default: test bov_d12 base_d12
#                                          bov_d12_xla_attention bov_d12_batch32)
# and the fused bank-layer decode kernel against XLA's gather (bov_jax/kernels/bank_decode.py):
#   bash scripts/gpu_bench.sh decode_test decode_xla decode_fused
# Results: JSON lines in $OUT/bench.jsonl and $OUT/decode.jsonl (default runs/gpu_bench/),
# each run's log beside them, and tables last. On a host whose Python lacks this project's packages
# (a GPU image with jax only), put wheels in .whl/ first and they are installed to
# /tmp/site, e.g. for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl flax==0.12.12 \
#     optax==0.2.8 orbax-checkpoint==0.12.8 grain==0.2.18 ml_collections==1.1.0 array-record portpicker
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out="${OUT:-runs/gpu_bench}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax',
flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, jax.devices())" || exit 1

bench() {  # name, then bench flags
  local name=$1; shift
  echo "== $name"
  timeout 200 python3 -m benchmarks.train --json "$@" 2>"$out/$name.err" |
    sed -u "s/^{/{\"run\": \"$name\", /" | tee -a "$out/bench.jsonl"
  grep -iE "error|exception" "$out/$name.err" | tail -3
  grep -A40 "^profile:" "$out/$name.err" || true
}
decode() {  # name, then bench flags
  local name=$1; shift
  echo "== $name"
  for batch in 1 8; do
    timeout 200 python3 -m benchmarks.decode --json --config=$bov --contexts=1024,4096 \
      --steps=64 --batch=$batch "$@" 2>>"$out/$name.err" |
      sed -u "s/^{/{\"run\": \"$name\", /" | tee -a "$out/decode.jsonl"
  done
  grep -iE "error|exception" "$out/$name.err" | tail -3
}
bov=configs/bov_135m.py
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(test bov_d12 base_d12 bov_d12_xla_attention bov_d12_batch32)
for run in "${runs[@]}"; do
  case $run in
    test)  # cuDNN flash attention against float32 XLA attention at the d12 shape
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py -k cudnn 2>&1 |
        tee "$out/pytest.log" | tail -5 ;;
    bov_d12) bench "$run" --config=$bov ;;
    base_d12) bench "$run" --config=configs/baseline_135m.py ;;
    bov_d12_xla_attention) bench "$run" --config=$bov --config.model.attention=xla ;;
    bov_d12_batch32) bench "$run" --config=$bov --config.train.device_batch_size=32 ;;
    bov_d12_batch32_profile)
      bench "$run" --config=$bov --config.train.device_batch_size=32 --profile="$out/profile" ;;
    bov_d12_batch32_no_triton_gemm)
      XLA_FLAGS=--xla_gpu_enable_triton_gemm=false bench "$run" --config=$bov \
        --config.train.device_batch_size=32 ;;
    bov_d12_batch32_loss_chunk8192)
      bench "$run" --config=$bov --config.train.device_batch_size=32 --config.model.loss_chunk=8192 ;;
    decode_test)  # the GPU kernel compiled by Triton against the gather-then-attend path
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_bank_decode.py \
        -k "gpu and not vocab_split" 2>&1 | tee "$out/pytest_decode.log" | tail -5 ;;
    decode_xla) decode "$run" --config.model.decode_attention=xla ;;
    decode_fused) decode "$run" --config.model.decode_attention=fused ;;
    *) echo "unknown run $run"; exit 2 ;;
  esac
done

python3 - "$out/bench.jsonl" "$out/decode.jsonl" <<'EOF'
import json, os, sys
tables = [  # file, then (column, width: < 0 left-aligned, its text from a result line)
    (sys.argv[1], [("run", -32, lambda r: r["run"]),
                   ("step_s", 7, lambda r: f"{r['step_s']:.3f}"),
                   ("tok/s", 9, lambda r: f"{r['tokens_per_s']:.0f}"),
                   ("TFLOP/s", 8, lambda r: f"{r['achieved_flops'] / 1e12:.1f}"),
                   ("MFU", 6, lambda r: f"{r['mfu']:.1%}"),
                   ("compile_s", 9, lambda r: f"{r['compile_s']:.1f}")]),
    (sys.argv[2], [("run", -14, lambda r: r["run"]),
                   ("preset", -34, lambda r: r["preset"]),
                   ("context", 7, lambda r: str(r["context"])),
                   ("batch", 5, lambda r: str(r["batch"])),
                   ("tok/s", 9, lambda r: f"{r['tokens_per_s']:.0f}")]),
]
for path, cols in tables:
  if os.path.exists(path):
    rows = [[name for name, _, _ in cols]]
    rows += [[text(json.loads(line)) for _, _, text in cols] for line in open(path)]
    for row in rows:
      print(" ".join(v.ljust(-w) if w < 0 else v.rjust(w) for v, (_, w, _) in zip(row, cols)))
EOF
