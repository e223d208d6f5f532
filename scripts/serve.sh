#!/usr/bin/env bash
# Install kdn into .venv and start the server on its embedded default:
# RAM tier + LMDB disk tier under ./kdn-data, listening on 127.0.0.1:50051. Extra args go to
# `kdn serve` (see `kdn serve --help`). The `model` extra (torch, transformers) comes with it so
# that `kdn rag` and `kdn serve --model` work; the server alone needs none of it. The server
# runs in the folder this is called from: relative paths (./kdn-data, --config my.yaml,
# $KDN_DATA_DIR) are the caller's, not the repository's.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
(cd "$root" && bash scripts/bootstrap.sh "${KDN_EXTRAS-model}")  # KDN_EXTRAS= : the slim server
exec "$root/.venv/bin/kdn" serve "$@"
