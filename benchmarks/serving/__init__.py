"""Helpers of bench_serving: workload, client, stacks, report, plots."""
