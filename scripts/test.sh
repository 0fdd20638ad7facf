#!/usr/bin/env bash
# Install everything, then run the whole test suite (CPU; CUDA tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
