#!/usr/bin/env bash
# Install everything, then start the whole stack with the default model (Ctrl-C stops it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec pagedserve up "$@"
