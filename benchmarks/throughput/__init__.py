"""Helpers of bench_throughput: workload, transformers baselines, step profile, decode-step timing."""
