#!/usr/bin/env bash
# Refresh requirements/lock.txt: every dependency of pagedserve[test] (and the build backend, for the
# editable install without build isolation) pinned to one version with its hashes, at the newest
# versions pyproject.toml allows today, with PyTorch's CPU build (requirements/torch-cpu.txt).
# Run scripts/check_latest.sh first: refresh the lock when it is green. Needs pip-tools (in ./.venv
# or on PATH); takes a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# (Not PIP_COMPILE: pip reads every PIP_* variable as an option, --compile here.)
PIP_COMPILE_BIN=${PIP_COMPILE_BIN:-$( [ -x .venv/bin/pip-compile ] && echo .venv/bin/pip-compile || echo pip-compile )}
"$PIP_COMPILE_BIN" --quiet --upgrade --generate-hashes --allow-unsafe --strip-extras \
    --no-emit-find-links --no-emit-index-url --extra test --all-build-deps \
    --constraint requirements/torch-cpu.txt --output-file requirements/lock.txt pyproject.toml
echo "lock.sh: requirements/lock.txt has $(grep -c '^[a-z]' requirements/lock.txt) packages"
