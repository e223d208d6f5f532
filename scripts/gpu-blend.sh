#!/usr/bin/env bash
# The blender's checks on a CUDA host (issue 53), in one go: its GPU tests (pytest -m gpu), then
# bench.blend --gpu (8B shape, 4x2k and 4x8k tokens, chunks resident and streamed); both run, and
# the exit status is 1 when either failed.
#
#   scripts/gpu-blend.sh [BENCH_ARGS...]        (results under $OUT: /tmp/kdn-gpu)
#
# Wheels in .whl/ are installed into /tmp/site first, as scripts/gpu-checks.sh does.
set -u -o pipefail  # a step's status is its command's, not tee's or tail's
failed=()
step() {  # NAME STATUS: every step runs; the script exits 1 at the end if any failed
    [ "$2" -eq 0 ] || failed+=("$1 (exit $2)")
}
OUT=${OUT:-/tmp/kdn-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
start=$(date +%s)
timeout 200 $PY -m pytest -m gpu -q -p no:cacheprovider -rs --timeout 150 \
    tests/test_blend_devices.py 2>&1 | tee "$OUT/pytest-blend-gpu.log" | tail -30
step "pytest -m gpu (blend)" $?
echo "pytest -m gpu (blend): $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout 420 $PY -m bench.blend --gpu --out "$OUT/blend_gpu.json" "$@" 2>&1 \
    | tee "$OUT/bench-blend-gpu.log" | { grep -v "^wrote" || true; }
step "bench.blend --gpu" $?
echo "bench.blend --gpu: $(( $(date +%s) - start )) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
