"""Helpers of bench_memory: the in-process block-manager benchmark."""
