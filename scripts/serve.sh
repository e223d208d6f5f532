#!/usr/bin/env bash
# Install kdn into .venv and start the server on its embedded default:
# RAM tier + LMDB disk tier under ./kdn-data, listening on 127.0.0.1:50051. Extra args go to
# `kdn serve` (see `kdn serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/kdn serve "$@"
