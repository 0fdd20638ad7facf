#!/usr/bin/env bash
# On a GPU machine: every CUDA-marked test, then the GPU benchmarks. Output under ${OUT:-out}/.
# Nothing is downloaded: the throughput benchmark uses a random-weight 1B-class Llama built in code.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
status=0
unset TRITON_INTERPRET
python -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$OUT/cuda_tests.txt" || status=1
# Every kernel test again, natively: without the interpreter they take CUDA tensors.
python -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/kernel_tests.txt" || status=1
python -m benchmarks.bench_kernels 2>&1 | tee "$OUT/bench_kernels.txt" || status=1
python -m benchmarks.bench_throughput --random-model-config 1b --device cuda --dtype bfloat16 --quick \
    2>&1 | tee "$OUT/bench_throughput.txt" || status=1
python -m benchmarks.bench_memory 2>&1 | tee "$OUT/bench_memory.txt" || status=1
exit $status
