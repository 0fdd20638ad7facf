"""Kernel micro-benchmarks beside `benchmarks/bench_kernels.py` (CPU attention: cpu_attention.py)."""
