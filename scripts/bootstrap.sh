#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install kdn into it: scripts/bootstrap.sh [EXTRAS]
# (comma-separated; `sglang`, `vllm` and `test` also install the pinned sglang / vllm extras,
# without deps)
# With an extra that needs torch, torch is installed first as the CPU build pinned below
# (override: KDN_TORCH_SPEC), so that the extra's "torch>=2.4" is already satisfied and nothing
# pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
  done
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch only for the extras that need it (model, bench, test): `bootstrap.sh` alone installs
# the storage side (server, admin CLI), which imports no torch
case ",$extras," in
  *,model,*|*,bench,*|*,test,*)
    if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
      "${pip[@]}" "${KDN_TORCH_SPEC:-torch==2.13.0}"
    fi ;;
esac
# the "sglang" and "vllm" extras are installed apart, without dependencies (see pyproject.toml);
# the test mode installs both, so the suite runs the SGLang backend's and the vLLM connector's
# tests against SGLang and vLLM themselves
nodeps=()
case ",$extras," in *,sglang,*|*,test,*) nodeps+=(sglang) ;; esac
case ",$extras," in *,vllm,*|*,test,*) nodeps+=(vllm) ;; esac
extras="$(printf '%s' "$extras" | tr ',' '\n' | grep -vx -e sglang -e vllm | paste -sd, - || true)"
if [ -n "$extras" ]; then "${pip[@]}" -e ".[$extras]"; else "${pip[@]}" -e .; fi
for extra in "${nodeps[@]}"; do
  mapfile -t pins < <(.venv/bin/python -c 'import sys, tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))' "$extra")
  "${pip[@]}" --no-deps "${pins[@]}"
done
