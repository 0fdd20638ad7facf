#!/usr/bin/env bash
# Install everything, lint the tree (ruff, [tool.ruff] in pyproject.toml: well under a second),
# then run the whole test suite (CPU; CUDA tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
exec python -m pytest -q -p no:cacheprovider "$@"
