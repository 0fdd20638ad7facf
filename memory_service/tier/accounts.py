"""What the tiers below the pool count, and the load-or-recompute estimate built on those counts.

``TierWorker`` (``worker.py``) moves the blocks; this module keeps its books, per tier (by its
``kind``: ``host``, ``disk``), under a lock of its own (never held while taking another: the
manager's lock may be held when it is called, never the other way round):

- Lookups (``count_lookup``, called by the block manager's book where it counts one): an allocation's
  lookup past the pool's prefix walks the blocks; each found block is a hit of the fastest tier that
  holds it; a miss of a tier is a block it lacked: found in a slower tier, or the end of the walk (so
  a miss of the slowest, the disk, is a walk that ended on a block no tier holds). A skipped load
  counts for each tier it would have read.
- Loads (``add_load`` when submitted, ``record`` when over): a load counts for each tier it is to read;
  its latency for the slowest tier it read; each tier's read bandwidth is an average of what past
  loads measured, weighted to the recent ones.
- Loading or recomputing (``worth_loading``): a load of ``n_host`` blocks from the host tier and
  ``n_disk`` from the disk takes about sum over tiers of (the bytes queued there for loads ahead of
  it + its own) / that tier's bandwidth (one loader thread reads them in turn); recomputing takes
  ``n * block_size`` tokens / the prefill speed the client measured and sent with its Step. The load
  goes ahead when it is the faster; while a figure it needs is unknown (a tier's first load, a client
  that sent none) it goes ahead. Both are rough (the disk's read bandwidth depends on the page cache;
  the prefill speed on the batch), which is why the comparison is a plain ratio and not a model: the
  cases it must catch (a slow disk against a fast GPU, where a file tier's hit can take longer than
  recomputing the prefix: docs/benchmarks.md) differ by far more than the error.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

from memory_service.manager.tier_book import TierLoad

# Weight of the newest load in the read bandwidths' moving averages.
BANDWIDTH_EWMA = 0.3
# Upper bounds (seconds) of the load latency histogram's buckets (the last one is +Inf).
LOAD_LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                          1.0, 2.5, 5.0, 10.0)


@dataclass
class _TierTally:
    """One tier's share of the lookups and loads, its measured read bandwidth and queue."""

    num_hits: int = 0
    num_misses: int = 0
    num_loads: int = 0
    num_loads_skipped: int = 0
    read_bytes_per_s: float | None = None
    queued_bytes: int = 0  # of loads submitted and not finished, to be read from this tier
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0  # loads counted for this tier: the slowest each read


@dataclass(frozen=True)
class TierCounts:
    """One tier's lookup and load counts (its share of ``TierStats``)."""

    num_hits: int
    num_misses: int
    num_loads: int
    num_loads_skipped: int


class TierAccounts:
    """Per-tier counters, queues and read bandwidths (module docstring).

    Args:
        kinds: the tiers' kinds, fastest first (``TierWorker.tiers``).
        bytes_per_block: bytes of one block in every tier.
        block_size: tokens per block.
        tier_of: the fastest tier that holds a key now, or None (in-memory lookups, no IO).
    """

    def __init__(self, kinds: list[str], bytes_per_block: int, block_size: int,
                 tier_of: Callable[[bytes], str | None]) -> None:
        self.kinds = tuple(kinds)
        self._tally = {kind: _TierTally() for kind in kinds}
        self._bytes_per_block = bytes_per_block
        self._block_size = block_size
        self._tier_of = tier_of
        self._queued: dict[int, dict[str, int]] = {}  # id(load) -> blocks by tier, as submitted
        self._lock = threading.Lock()

    def split(self, keys: list[bytes]) -> dict[str, int]:
        """Blocks of ``keys`` by the fastest tier holding each (a block no tier holds counts nowhere)."""
        split = dict.fromkeys(self._tally, 0)
        for key in keys:
            kind = self._tier_of(key)
            if kind is not None:
                split[kind] += 1
        return split

    def count_lookup(self, keys: list[bytes], num_found: int, is_skipped: bool) -> None:
        """Counts an allocation's lookup past the pool's prefix in each tier, once: its first
        ``num_found`` blocks of ``keys`` were found, the walk ended short unless that is all of them."""
        split = self.split(keys[:num_found])
        is_short = num_found < len(keys)
        with self._lock:
            for kind, count in split.items():
                self._tally[kind].num_hits += count
                self._tally[kind].num_loads_skipped += is_skipped and count > 0
            # What each tier lacked: blocks found in a slower tier, or the end of the walk.
            num_slower = 0
            for kind in reversed(self.kinds):
                self._tally[kind].num_misses += num_slower + is_short
                num_slower += split[kind]

    def worth_loading(self, keys: list[bytes], prefill_tokens_per_s: float) -> bool:
        """Whether loading the blocks ``keys`` (all held by some tier) is estimated faster than
        recomputing them (module docstring); True while a figure it needs is unknown."""
        split = self.split(keys)
        with self._lock:
            load_s = 0.0
            for kind, tally in self._tally.items():
                num_bytes = tally.queued_bytes + split[kind] * self._bytes_per_block
                if num_bytes == 0:
                    continue
                if tally.read_bytes_per_s is None:
                    return True
                load_s += num_bytes / tally.read_bytes_per_s
        if prefill_tokens_per_s <= 0:
            return True
        return load_s < len(keys) * self._block_size / prefill_tokens_per_s

    def add_load(self, load: TierLoad) -> None:
        """A load submitted to the loader: its bytes join each tier's queue, and it counts as a load
        of each tier it is to read."""
        split = self.split(load.hashes)
        with self._lock:
            self._queued[id(load)] = split
            for kind, count in split.items():
                self._tally[kind].queued_bytes += count * self._bytes_per_block
                self._tally[kind].num_loads += count > 0

    def record(self, load: TierLoad, num_read: dict[str, int], read_s: dict[str, float], elapsed_s: float) -> None:
        """A load is over: its share of the queues leaves them, its latency counts for the slowest
        tier it read, and each tier it read updates its read bandwidth.

        Args:
            load: a load of ``add_load``.
            num_read: blocks it read, per tier.
            read_s: seconds it spent reading, per tier.
            elapsed_s: its whole duration.
        """
        slowest = next((kind for kind in reversed(self.kinds) if num_read.get(kind)), self.kinds[0])
        with self._lock:
            for kind, count in self._queued.pop(id(load)).items():
                self._tally[kind].queued_bytes -= count * self._bytes_per_block
            tally = self._tally[slowest]
            tally.latency_counts[bisect_left(LOAD_LATENCY_BUCKETS_S, elapsed_s)] += 1
            tally.latency_sum_s += elapsed_s
            for kind, count in num_read.items():
                if count and read_s[kind] > 0:
                    tally = self._tally[kind]
                    bandwidth = count * self._bytes_per_block / read_s[kind]
                    old = tally.read_bytes_per_s
                    tally.read_bytes_per_s = bandwidth if old is None else old + BANDWIDTH_EWMA * (bandwidth - old)

    def counts(self) -> dict[str, TierCounts]:
        """Each tier's lookup and load counts, fastest first."""
        with self._lock:
            return {kind: TierCounts(t.num_hits, t.num_misses, t.num_loads, t.num_loads_skipped)
                    for kind, t in self._tally.items()}

    def load_latency(self) -> dict[str, tuple[list[tuple[float, int]], float]]:
        """Per tier, the load latency histogram: cumulative ``(upper bound s, count)`` buckets (+Inf
        last) and the sum of the latencies in seconds. A load counts for the slowest tier it read."""
        result = {}
        with self._lock:
            for kind, tally in self._tally.items():
                buckets, cumulative = [], 0
                for bound, count in zip((*LOAD_LATENCY_BUCKETS_S, float("inf")), tally.latency_counts):
                    cumulative += count
                    buckets.append((bound, cumulative))
                result[kind] = (buckets, tally.latency_sum_s)
        return result
