"""The LRU of one pool's evictable blocks: a FIFO list with lazy removal.

Why not an ``OrderedDict``: on the service's hot path every block freed with a cache key joins
the LRU and, once the pool is full, every block taken is evicted from it. An ``OrderedDict``
pays a hash-table insert and a linked-list node per join, and a lookup per block read in order;
here a join is a list append and an eviction of ``n`` blocks one list slice (the LRU's share of
``benchmarks/memory/block_manager_bench.py``'s run: docs/benchmarks.md, "Figures behind the code's
choices").

Leaving the LRU other than by eviction (a cached block shared again) is the rare case: the block's
entry stays in the list and is counted *stale*; it is skipped when eviction reaches it. A block may
rejoin later: its new entry is appended behind its stale ones, so at any time a block's entries are,
oldest first, ``stale[block_id]`` stale ones then at most one live one, which exists iff the block
is evictable. Eviction order is therefore exactly least-recently-joined first, as with an
``OrderedDict`` whose entries are deleted on share and appended on release.

Memory stays bounded: consumed entries are dropped once they are half the list, and stale ones
once they outnumber the live ones (and the threshold), so the list holds at most about four entries
per block of the pool; each compaction is one pass over the list, paid for by the appends or shares
that made the entries it drops. Dropping stale entries walks the list in Python (a fraction of a
second per million entries), so at the largest pool (2**20 blocks) the share that triggers it may
take that long, once per as many shares; dropping consumed entries is one C ``memmove``.
"""

from __future__ import annotations

from collections.abc import Iterator

# Compact only lists at least this long: small ones cost nothing to keep.
MIN_COMPACT_LENGTH = 1024


class EvictionQueue:
    """Block ids in the order they became evictable; ``pop_oldest`` takes the least recently used.

    Invariants (``check_integrity``): ``len(self)`` is the number of live entries; each block has at
    most one live entry, and it comes after all of that block's stale entries.

    Args:
        min_compact_length: compact the list only from this many consumed or stale entries.
    """

    __slots__ = ("_ids", "_head", "_stale", "_num_stale", "_min_compact_length", "append")

    def __init__(self, min_compact_length: int = MIN_COMPACT_LENGTH) -> None:
        self._min_compact_length = min_compact_length
        self._ids: list[int] = []  # entries before _head are consumed
        self._head = 0
        self._stale: dict[int, int] = {}  # block id -> its stale entries (all older than its live one)
        self._num_stale = 0
        # The hot path: a block becoming evictable is the bound list append itself, no wrapper call.
        self.append = self._ids.append

    def __len__(self) -> int:
        return len(self._ids) - self._head - self._num_stale

    def __iter__(self) -> Iterator[int]:
        """Yields the live entries, least recently used first (changes nothing)."""
        pending_stale = dict(self._stale)
        for block_id in self._ids[self._head :]:
            num_stale = pending_stale.get(block_id)
            if num_stale:
                pending_stale[block_id] = num_stale - 1
            else:
                yield block_id

    def remove(self, block_id: int) -> None:
        """Takes an evictable block off the LRU (it is shared again); its entry turns stale.

        Args:
            block_id: a block with a live entry.
        """
        self._stale[block_id] = self._stale.get(block_id, 0) + 1
        self._num_stale += 1
        if self._num_stale >= self._min_compact_length and self._num_stale > len(self):
            self._ids[:] = list(self)  # in place: ``append`` stays bound to this list
            self._head = 0
            self._stale.clear()
            self._num_stale = 0

    def pop_oldest(self, num_blocks: int) -> list[int]:
        """Takes the least recently used blocks off the LRU.

        Args:
            num_blocks: how many; at most ``len(self)``.

        Returns:
            The block ids, least recently used first.
        """
        ids, head = self._ids, self._head
        if not self._stale:  # the common case: one slice
            block_ids = ids[head : head + num_blocks]
            head += len(block_ids)
        else:
            stale, block_ids = self._stale, []
            while len(block_ids) < num_blocks:
                block_id = ids[head]
                head += 1
                num_stale = stale.get(block_id)
                if num_stale is None:
                    block_ids.append(block_id)
                else:
                    self._num_stale -= 1
                    if num_stale == 1:
                        del stale[block_id]
                    else:
                        stale[block_id] = num_stale - 1
        if len(block_ids) != num_blocks:
            raise AssertionError(f"popped {len(block_ids)} of {num_blocks} blocks from an LRU of {len(self)}")
        if head >= self._min_compact_length and 2 * head >= len(ids):
            del ids[:head]
            head = 0
        self._head = head
        return block_ids

    def check_integrity(self) -> None:
        """Raises AssertionError unless each block has its stale entries plus at most one live one,
        and the live ones add up to ``len(self)``."""
        if self._num_stale != sum(self._stale.values()) or any(n < 1 for n in self._stale.values()):
            raise AssertionError(f"{self._num_stale} stale entries counted, the counts say {self._stale}")
        num_entries: dict[int, int] = {}
        for block_id in self._ids[self._head :]:
            num_entries[block_id] = num_entries.get(block_id, 0) + 1
        num_live = 0
        for block_id in num_entries.keys() | self._stale.keys():
            num_block_live = num_entries.get(block_id, 0) - self._stale.get(block_id, 0)
            if num_block_live not in (0, 1):
                raise AssertionError(f"block {block_id}: {num_entries.get(block_id, 0)} entries, "
                                     f"{self._stale.get(block_id, 0)} stale")
            num_live += num_block_live
        if num_live != len(self):
            raise AssertionError(f"{num_live} live entries but {len(self)} counted")
