#!/usr/bin/env bash
# What a session lent a GPU host prepares here before its first device call, so that its
# device time goes to measuring: the wheels of kdn's storage side that the host's image lacks
# (.whl/, the versions this checkout's .venv runs, for the host's CPython 3.12), and real
# SmolLM2 KV for the GPU/CPU bit-identity test (.devdata/real-kv, written from the packaged
# model). Both folders are kept out of git (.git/info/exclude) and travel with `carry`:
#
#   bash scripts/gpu-prepare.sh            # then: run(carry=[".whl", ".devdata"],
#                                           #   command="bash scripts/gpu-checks.sh 240")
#
# PY (default .venv/bin/python) is the Python whose package versions are carried.
set -eu
PY=${PY:-.venv/bin/python}
for dir in /.whl/ /.devdata/; do
    grep -qxF "$dir" .git/info/exclude 2>/dev/null || echo "$dir" >>.git/info/exclude
done
rm -rf .whl && mkdir -p .whl .devdata
# the image holds torch, transformers, triton, numba, grpcio, xxhash, numpy, yaml, prometheus
# and tqdm; protobuf and grpcio travel too: the generated stubs need this protobuf runtime
names="grpcio grpcio-health-checking grpcio-reflection protobuf redis zstandard lmdb"
pins=$($PY - "$names" <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1].split()))
EOF
)
plat=""
for n in 17 27 28 34; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
if [ ! -d .devdata/real-kv ] || [ -z "$(ls -A .devdata/real-kv)" ]; then
    PYTHONPATH=$PWD $PY -m tests.test_gpu_decode .devdata/real-kv 1024  # 2048: 43 MB
fi
du -sh .whl .devdata | sed 's/^/carry: /'  # with the checkout: 64 MiB a call at most
