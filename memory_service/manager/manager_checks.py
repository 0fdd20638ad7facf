"""The block manager's stats and integrity check: whole-state scans, off the hot path.

Kept apart from ``block_manager`` so that the module that serves every step stays short; both
functions read the manager's state and change nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pagedserve.sampling_rules import num_blocks_for

from memory_service.manager.block_pool import BlockPool
from memory_service.manager.block_types import BlockManagerStats
from memory_service.manager.op_apply import OpApplier, SequenceState
from memory_service.manager.prefix_cache import PrefixCache
from memory_service.token_encoding import TOKEN_WIDTH


def collect_stats(
    client_seqs: Mapping[str, Mapping[str, SequenceState]], pool: BlockPool, applier: OpApplier, block_size: int
) -> BlockManagerStats:
    """Counts blocks per pool, utilization, and the prefix-cache and event counters; O(blocks in use).

    Args:
        client_seqs: client_id -> its live sequences.
        pool: the block pool.
        applier: the op applier (its counters).
        block_size: tokens per block.

    Returns:
        The snapshot.
    """
    num_filled: dict[int, int] = {}  # used block -> tokens it holds (the most any table stores in it)
    for seq in (seq for seqs in client_seqs.values() for seq in seqs.values()):
        table = seq.block_table
        for block_id in table[:-1]:
            num_filled[block_id] = block_size
        last = seq.num_tokens - (len(table) - 1) * block_size
        if num_filled.get(table[-1], 0) < last:
            num_filled[table[-1]] = last
    num_slots = len(num_filled) * block_size
    num_stored = sum(num_filled.values())
    return BlockManagerStats(
        pools=pool.stats(),
        kv_utilization=num_stored / num_slots if num_slots else 0.0,
        fragmentation=(num_slots - num_stored) / num_slots if num_slots else 0.0,
        prefix_cache_queries=applier.num_prefix_cache_queries,
        prefix_cache_hits=applier.num_prefix_cache_hits,
        num_evictions=pool.num_evictions,
        num_copy_on_writes=applier.num_copy_on_writes,
        num_sequences=sum(map(len, client_seqs.values())),
        num_clients=len(client_seqs),
        block_size=block_size,
    )


def check_integrity(
    client_seqs: Mapping[str, Mapping[str, SequenceState]],
    pending: Mapping[str, Mapping[int, None]],
    pool: BlockPool,
    prefix_cache: PrefixCache | None,
    block_size: int,
    pinned_block_ids: Iterable[int] = (),
) -> None:
    """Checks every invariant of the block manager; O(pool size), for tests and debugging.

    Checked: each block is free, cached or used; per pool ``free + cached + used == total``;
    refcount == number of block tables holding the block; free blocks have no cache key, evictable
    ones have one; the prefix cache's keys are unique and consistent; each table fits its
    sequence's token count; a pending block is referenced, and listed by exactly the client that
    owns it.

    Args:
        client_seqs: client_id -> its live sequences.
        pending: client_id -> its uncommitted cache blocks.
        pool: the block pool.
        prefix_cache: the prefix cache (None: disabled).
        block_size: tokens per block.
        pinned_block_ids: references held outside the block tables (tier loads in flight), one per entry.

    Raises:
        AssertionError: naming the first broken invariant (a bug, never bad input).
    """
    num_blocks = pool.num_blocks
    expected_ref_counts = [0] * num_blocks
    for block_id in pinned_block_ids:
        expected_ref_counts[block_id] += 1
    for seqs in client_seqs.values():
        for seq_id, seq in seqs.items():
            table = seq.block_table
            if seq.num_tokens < 1 or len(table) != num_blocks_for(seq.num_tokens, block_size):
                raise AssertionError(f"seq {seq_id!r}: {len(table)} blocks for {seq.num_tokens} tokens")
            if len(set(table)) != len(table) or not all(0 <= b < num_blocks for b in table):
                raise AssertionError(f"seq {seq_id!r}: bad block table {table}")
            num_partial = len(seq.partial_token_bytes) // TOKEN_WIDTH
            if prefix_cache is not None and num_partial != seq.num_tokens % block_size:
                raise AssertionError(f"seq {seq_id!r}: {num_partial} pending tokens for {seq.num_tokens}")
            for block_id in table:
                expected_ref_counts[block_id] += 1
    if pending.keys() != client_seqs.keys():
        raise AssertionError("the clients with pending blocks are not the attached ones")
    pool.check_integrity(expected_ref_counts)
    if prefix_cache is not None:
        owners = prefix_cache.pending_owners
        num_pending = sum(map(len, pending.values()))
        if num_pending != sum(owner is not None for owner in owners):
            raise AssertionError(f"{num_pending} pending blocks listed, but the cache marks others")
        for client_id, client_pending in pending.items():
            for block_id in client_pending:
                if owners[block_id] != client_id or not expected_ref_counts[block_id]:
                    raise AssertionError(f"pending block {block_id} of {client_id!r}: wrong owner or unreferenced")
