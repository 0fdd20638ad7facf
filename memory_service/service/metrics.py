"""Prometheus metrics of the memory service, read from the block manager at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from memory_service.manager.block_types import BlockManagerStats


class MemoryStatsCollector(Collector):
    """Exposes the same figures as the Stats RPC under ``pagedserve_memory_*`` (the tiers' under
    ``pagedserve_memory_tier_*``, labelled by tier: "host", "disk"), and the tiers' load latency
    histograms.

    Args:
        stats: returns a snapshot; called from the metrics server's thread at each scrape.
        load_latency: returns, per tier, its load latency buckets (cumulative ``(upper bound s,
            count)``, +Inf last) and their sum; empty without a tier (``TierWorker.load_latency``).
    """

    def __init__(self, stats: Callable[[], BlockManagerStats],
                 load_latency: Callable[[], dict[str, tuple[list[tuple[float, int]], float]]] = dict) -> None:
        self._stats = stats
        self._load_latency = load_latency

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
        yield from self._collect_tiers(s)

    def _collect_tiers(self, s: BlockManagerStats) -> Iterator:
        gauges = {"blocks": ("num_blocks", "Blocks a tier below the pool holds"),
                  "bytes": ("num_bytes", "Bytes of a tier's blocks (the disk's: files, headers included)"),
                  "capacity_bytes": ("capacity_bytes", "The most bytes a tier may hold")}
        counters = {"hits_blocks": ("num_hits", "Blocks found in a tier past the pool's cached prefix "
                                            "(in the fastest tier that holds them)"),
                    "misses": ("num_misses", "Tier lookups that ended on a missing block (host: also each "
                                             "block it lacked that the disk held)"),
                    "written_bytes": ("num_bytes_written", "Bytes written to a tier (write-behind)"),
                    "read_bytes": ("num_bytes_read", "Bytes read from a tier (loads)"),
                    "write_errors": ("num_write_errors", "Blocks dropped by a failed write (disk full, I/O; "
                                                         "host: every slot held by loads)"),
                    "bad_files": ("num_bad_files", "Tier files found damaged or foreign, removed"),
                    "loads": ("num_loads", "Tier loads started"),
                    "loads_skipped": ("num_loads_skipped", "Tier loads skipped: recompute estimated faster"),
                    "missed_blocks": ("num_blocks_missed", "Committed blocks evicted before the tier's writer "
                                                           "reached them (it yields the cores to the engine)")}
        for families, kind in ((gauges, GaugeMetricFamily), (counters, CounterMetricFamily)):
            for suffix, (field, text) in families.items():
                family = kind(f"pagedserve_memory_tier_{suffix}", text, labels=["tier"])
                for tier in s.tiers:
                    family.add_metric([tier.kind], getattr(tier, field))
                yield family
        latency = self._load_latency()
        if latency:
            family = HistogramMetricFamily("pagedserve_memory_tier_load_seconds",
                                           "Time to load one allocation's blocks from the tiers (counted for the "
                                           "slowest tier it read)", labels=["tier"])
            for kind, (buckets, total_s) in latency.items():
                family.add_metric([kind], [(str(bound) if bound != float("inf") else "+Inf", count)
                                           for bound, count in buckets], total_s)
            yield family
