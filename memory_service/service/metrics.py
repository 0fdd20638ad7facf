"""Prometheus metrics of the memory service, read from the block manager at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from memory_service.manager.block_types import BlockManagerStats


class MemoryStatsCollector(Collector):
    """Exposes the same figures as the Stats RPC under ``pagedserve_memory_*``.

    Args:
        stats: returns a snapshot; called from the metrics server's thread at each scrape.
    """

    def __init__(self, stats: Callable[[], BlockManagerStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        blocks = GaugeMetricFamily("pagedserve_memory_blocks", "KV blocks by pool and state", labels=["pool", "state"])
        for p in s.pools:
            blocks.add_metric([p.name, "total"], p.num_total_blocks)
            blocks.add_metric([p.name, "free"], p.num_free_blocks)
            blocks.add_metric([p.name, "cached"], p.num_cached_blocks)
            blocks.add_metric([p.name, "used"], p.num_used_blocks)
        yield blocks
        yield GaugeMetricFamily("pagedserve_memory_kv_utilization", "Tokens stored / capacity of used blocks",
                                value=s.kv_utilization)
        yield GaugeMetricFamily("pagedserve_memory_fragmentation", "Unused slots in used blocks / their slots",
                                value=s.fragmentation)
        yield GaugeMetricFamily("pagedserve_memory_sequences", "Live sequences", value=s.num_sequences)
        yield GaugeMetricFamily("pagedserve_memory_clients", "Attached clients", value=s.num_clients)
        yield CounterMetricFamily("pagedserve_memory_prefix_cache_queries_tokens", "Prompt tokens looked up",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("pagedserve_memory_prefix_cache_hits_tokens", "Prompt tokens found cached",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily("pagedserve_memory_evictions", "Cached blocks evicted", value=s.num_evictions)
        yield CounterMetricFamily("pagedserve_memory_copy_on_writes", "Blocks copied on write",
                                  value=s.num_copy_on_writes)
