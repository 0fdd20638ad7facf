"""Block pool: the state of every KV block id, split into a general and a priority-reserved pool.

Per pool, every block is in exactly one state:

    free     refcount 0, no cache key     on the pool's free list
    cached   refcount 0, a cache key      on the pool's LRU of evictable blocks
    used     refcount n >= 1              in the block tables of n sequences (cache key or not)

Ordering rules (tests assert exact block ids against them):

- Each free list is a stack. A fresh pool hands out increasing ids: 0, 1, 2, ... (the reserved
  pool: ``num_general_blocks``, ...). Released blocks are pushed in the order given, so releasing
  a table tail first hands it back head first, in table order.
- ``take`` serves the general pool's free list, then evicts the general pool's least recently used
  cached blocks; when allowed, the reserved pool's free list, then its LRU, in that order.
- Released cached blocks join their LRU in the order given: release a table tail first and its
  tail is evicted before its head (a prefix is worth more than what follows it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memory_service.manager.block_types import PoolStats
from memory_service.manager.eviction_queue import EvictionQueue
from memory_service.manager.prefix_cache import PrefixCache

GENERAL, RESERVED = 0, 1  # pool index; a block's pool is `block_id >= num_general_blocks`
POOL_NAMES = ("general", "reserved")


class BlockPool:
    """Free lists, reference counts and LRUs of evictable cached blocks, per pool.

    Args:
        num_blocks: block ids ``[0, num_blocks)``.
        num_general_blocks: ids below it form the general pool, the rest the reserved pool.
        prefix_cache: the cache that keys full blocks (None: prefix caching disabled).
    """

    def __init__(self, num_blocks: int, num_general_blocks: int, prefix_cache: PrefixCache | None) -> None:
        self.num_blocks = num_blocks
        self.num_general_blocks = num_general_blocks
        self.prefix_cache = prefix_cache
        # Without prefix caching no block ever has a key; the list keeps `release` branch-free.
        self._block_keys = prefix_cache.block_keys if prefix_cache is not None else [None] * num_blocks
        self.ref_counts = [0] * num_blocks  # read freely; changed only through this class
        # Per block, how many times ``take`` handed it out: a block's bytes change only after a take,
        # so a copy made between two reads of the same generation is of unchanged bytes (the tier's
        # writer copies committed blocks outside the manager's lock, tier/worker.py).
        self.generations = [0] * num_blocks
        # Stacks whose top is the end, filled in reverse to hand out increasing ids.
        self._free_block_ids = (
            list(range(num_general_blocks - 1, -1, -1)),
            list(range(num_blocks - 1, num_general_blocks - 1, -1)),
        )
        self._evictable_block_ids = (EvictionQueue(), EvictionQueue())  # the LRUs
        self.num_evictions = 0

    def num_available(self, may_use_reserved: bool, sharing: Sequence[int] = ()) -> int:
        """Returns how many blocks ``take`` can hand out, once ``share(sharing)`` has run.

        Args:
            may_use_reserved: count the reserved pool too.
            sharing: blocks about to be shared; the evictable ones among them leave their LRU and
                cannot also be evicted.

        Returns:
            Free plus evictable blocks of the allowed pools.
        """
        free, evictable = self._free_block_ids, self._evictable_block_ids
        num = len(free[GENERAL]) + len(evictable[GENERAL])
        if may_use_reserved:
            num += len(free[RESERVED]) + len(evictable[RESERVED])
        ref_counts, num_general = self.ref_counts, self.num_general_blocks
        for block_id in sharing:
            if ref_counts[block_id] == 0 and (block_id < num_general or may_use_reserved):
                num -= 1
        return num

    def share(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to each block; an evictable one leaves its LRU (zero-copy sharing).

        Args:
            block_ids: used or evictable blocks.
        """
        ref_counts, num_general, evictable = self.ref_counts, self.num_general_blocks, self._evictable_block_ids
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                evictable[block_id >= num_general].remove(block_id)
            ref_counts[block_id] += 1

    def take(self, num_blocks: int, may_use_reserved: bool) -> list[int]:
        """Takes blocks for new content, refcount 1 each; evicted ones lose their cache key.

        Args:
            num_blocks: how many; the caller checked ``num_available``.
            may_use_reserved: whether the reserved pool may serve once the general one is empty.

        Returns:
            The block ids, in the order of the module docstring's rules.
        """
        free = self._free_block_ids[GENERAL]
        if 0 < num_blocks <= len(free):  # the common case: plain free blocks of the general pool
            block_ids = free[-num_blocks:]
            del free[-num_blocks:]
            block_ids.reverse()
        else:
            block_ids = []
            for pool in (GENERAL, RESERVED) if may_use_reserved else (GENERAL,):
                free = self._free_block_ids[pool]
                num_taken = min(num_blocks - len(block_ids), len(free))
                if num_taken:
                    block_ids += reversed(free[-num_taken:])
                    del free[-num_taken:]
                evictable = self._evictable_block_ids[pool]
                num_evicted = min(num_blocks - len(block_ids), len(evictable))
                if num_evicted:
                    block_ids += self.prefix_cache.evict(evictable, num_evicted)
                    self.num_evictions += num_evicted
            if len(block_ids) != num_blocks:
                raise AssertionError(f"took {len(block_ids)} of {num_blocks} blocks the caller found available")
        ref_counts, generations = self.ref_counts, self.generations
        for block_id in block_ids:
            ref_counts[block_id] = 1
            generations[block_id] += 1
        return block_ids

    def release(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block, in order; an unreferenced one joins its pool's LRU
        when it has a cache key, its free list otherwise.

        Args:
            block_ids: used blocks.
        """
        ref_counts, block_keys, num_general = self.ref_counts, self._block_keys, self.num_general_blocks
        free, evictable = self._free_block_ids, self._evictable_block_ids
        for block_id in block_ids:
            ref_count = ref_counts[block_id] = ref_counts[block_id] - 1
            if ref_count == 0:
                if block_keys[block_id] is None:
                    free[block_id >= num_general].append(block_id)
                else:
                    evictable[block_id >= num_general].append(block_id)

    def num_available_blocks(self) -> tuple[int, int]:
        """Tells how many blocks ``take`` could hand out from each pool; O(1).

        Returns:
            Free plus evictable blocks of (the general pool, the reserved pool).
        """
        free, evictable = self._free_block_ids, self._evictable_block_ids
        return len(free[GENERAL]) + len(evictable[GENERAL]), len(free[RESERVED]) + len(evictable[RESERVED])

    def stats(self) -> tuple[PoolStats, PoolStats]:
        """Counts the blocks of each pool by state.

        Returns:
            The general pool's counts, then the reserved pool's.
        """
        pools = []
        for pool, (lo, hi) in enumerate(self._ranges()):
            num_free, num_cached = len(self._free_block_ids[pool]), len(self._evictable_block_ids[pool])
            pools.append(PoolStats(POOL_NAMES[pool], hi - lo, num_free, num_cached, hi - lo - num_free - num_cached))
        return pools[0], pools[1]

    def check_integrity(self, expected_ref_counts: list[int]) -> None:
        """Raises AssertionError unless each block is in exactly one state of its own pool and the
        refcounts are the expected ones.

        Args:
            expected_ref_counts: per block, the number of block tables holding it.
        """
        if expected_ref_counts != self.ref_counts:
            block_id = next(b for b in range(self.num_blocks) if expected_ref_counts[b] != self.ref_counts[b])
            ref_count, num_tables = self.ref_counts[block_id], expected_ref_counts[block_id]
            raise AssertionError(f"block {block_id}: refcount {ref_count} but {num_tables} tables hold it")
        for pool, (lo, hi) in enumerate(self._ranges()):
            free, lru = self._free_block_ids[pool], self._evictable_block_ids[pool]
            lru.check_integrity()
            evictable = list(lru)
            if len(set(free)) != len(free) or not set(free).isdisjoint(evictable):
                raise AssertionError(f"{POOL_NAMES[pool]} pool: a block is listed twice in free/evictable")
            for block_id in free:
                if not lo <= block_id < hi or self.ref_counts[block_id] or self._block_keys[block_id] is not None:
                    raise AssertionError(f"free block {block_id}: wrong pool, referenced or cached")
            for block_id in evictable:
                if not lo <= block_id < hi or self.ref_counts[block_id] or self._block_keys[block_id] is None:
                    raise AssertionError(f"evictable block {block_id}: wrong pool, referenced or not cached")
            num_used = sum(1 for b in range(lo, hi) if self.ref_counts[b])
            if len(free) + len(evictable) + num_used != hi - lo:
                counts = f"free {len(free)} + cached {len(evictable)} + used {num_used}"
                raise AssertionError(f"{POOL_NAMES[pool]} pool: {counts} != {hi - lo} blocks")
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        elif any(key is not None for key in self._block_keys):
            raise AssertionError("a block has a cache key with prefix caching disabled")

    def _ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (0, self.num_general_blocks), (self.num_general_blocks, self.num_blocks)
