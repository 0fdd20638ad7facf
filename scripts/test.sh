#!/usr/bin/env bash
# Install everything, lint the tree (ruff, [tool.ruff] in pyproject.toml: well under a second),
# then run the whole test suite (CPU; CUDA tests skip themselves) on one pytest-xdist worker per
# core, up to 4 (PAGEDSERVE_TEST_WORKERS overrides; 0 runs in this process). A test module's tests
# stay on one worker (--dist loadfile: its module-scoped stack starts once), and each worker's
# models take their share of the cores (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
cores=$(python -c "import os; print(len(os.sched_getaffinity(0)))")
workers=${PAGEDSERVE_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
if [ "$workers" -gt 1 ]; then
    exec python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
fi
exec python -m pytest -q -p no:cacheprovider "$@"
