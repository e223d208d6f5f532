#!/usr/bin/env bash
# kdn's checks on a CUDA host, in one go: the GPU tests (pytest -m gpu), then bench.gpu, then
# bench.heap (NO_HEAP=1 skips it), then (with LINK_S=seconds) bench.link; every step runs, and
# the exit status is 1 when any of them failed (each is named on stderr).
#
#   scripts/gpu-checks.sh [BENCH_BUDGET_S [BENCH_ARGS...]]   (results under $OUT: /tmp/kdn-gpu)
#
# For a host whose Python lacks kdn's storage dependencies: wheels in .whl/ are installed into
# /tmp/site first (no network needed). Real SmolLM2 KV for the GPU/CPU bit-identity test comes
# from the packaged model, or from $KDN_REAL_KV (default .devdata/real-kv when present), written
# on a host with the model by `python -m tests.test_gpu_decode DIR`. `scripts/gpu-prepare.sh`
# makes both here (.whl/ and .devdata/), to be carried: run(carry=[".whl", ".devdata"], ...).
set -u -o pipefail  # a step's status is its command's, not tee's or tail's
failed=()
step() {  # NAME STATUS: every step runs; the script exits 1 at the end if any failed
    [ "$2" -eq 0 ] || failed+=("$1 (exit $2)")
}
OUT=${OUT:-/tmp/kdn-gpu}
BUDGET=${1:-240}
shift || true
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
REAL_KV=${KDN_REAL_KV:-}
if [ -z "$REAL_KV" ] && [ -d .devdata/real-kv ]; then
    REAL_KV=$PWD/.devdata/real-kv
fi
unset KDN_REAL_KV  # kdn serve refuses KDN_* variables it does not know
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY - <<'EOF'
import grpc, numba, torch, transformers, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      "transformers", transformers.__version__, "triton", triton.__version__,
      "numba", numba.__version__, "grpc", grpc.__version__)
from kdn.codec import gpu_plan
print("planner tables through libzstd:", gpu_plan.HAVE_ZSTD)
EOF
step "environment" $?
start=$(date +%s)
KDN_REAL_KV=$REAL_KV timeout 240 $PY -m pytest -m gpu -q -p no:cacheprovider -rs --timeout 200 \
    tests/test_gpu_decode.py tests/test_gpu_batch.py tests/test_engine_devices.py tests/test_dataplane.py \
    tests/test_local_tier.py tests/test_arena.py tests/test_staged.py tests/test_defaults.py \
    tests/test_decode_streams.py tests/test_device_index.py tests/test_blend_devices.py \
    tests/test_hit_memory.py 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
step "pytest -m gpu" $?
echo "pytest -m gpu: $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout $(( BUDGET + 150 )) $PY -m bench.gpu --budget-s "$BUDGET" --out "$OUT/gpu.json" "$@" 2>&1 \
    | tee "$OUT/bench-gpu.log" | { grep -v "^wrote" || true; }
step "bench.gpu" $?
echo "bench.gpu: $(( $(date +%s) - start )) s"
if [ -z "${NO_HEAP:-}" ]; then  # GPU hits and the garbage collector (bench.heap, ~1 min)
    start=$(date +%s)
    timeout 150 $PY -m bench.heap --out "$OUT/heap_gpu.json" 2>&1 | tee "$OUT/bench-heap.log" \
        | { grep -v "^wrote" || true; }
    step "bench.heap" $?
    echo "bench.heap: $(( $(date +%s) - start )) s"
fi
if [ -n "${LINK_S:-}" ]; then  # LINK_S=300: hit TTFT against emulated links (bench.link)
    start=$(date +%s)
    timeout "$LINK_S" $PY -m bench.link ${LINK_ARGS:-} --out "$OUT/gpu_link.json" 2>&1 \
        | tee "$OUT/bench-link.log" | { grep -v "^wrote" || true; }
    step "bench.link" $?
    echo "bench.link: $(( $(date +%s) - start )) s"
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
