"""Phases of bench_kv_tier that need more than one screen: the tier's faults on real processes, and
the no-reuse throughput of the realistic workload."""
