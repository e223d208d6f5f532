#!/usr/bin/env bash
# Install kdn into .venv and start the server on its embedded default:
# RAM tier + LMDB disk tier under ./kdn-data, listening on 127.0.0.1:50051. Extra args go to
# `kdn serve` (see `kdn serve --help`). The `model` extra (torch, transformers) comes with it so
# that `kdn rag` and `kdn serve --model` work; the server alone needs none of it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh "${KDN_EXTRAS-model}"  # KDN_EXTRAS= (empty): the slim server only
exec .venv/bin/kdn serve "$@"
