"""Applying a validated batch of ops: how each op changes a sequence's blocks.

``op_validation`` checks a batch; ``OpApplier`` applies it, one op at a time, against the block
pool and the prefix cache; ``block_manager`` owns the clients and their sequences and calls both.
The ordering rules that tests assert (which block ids an op gets) are in ``block_manager``'s and
``block_pool``'s docstrings.

The hot path of the service: each op's applier is one flat method (no helper calls on the common
path: in CPython a call costs as much as several lines, but for ``num_blocks_for``, the one
statement of the block arithmetic, ~0.1 us an op), and what the pool and the cache keep per block
is read through plain lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.sampling_rules import num_blocks_for

from memory_service.manager.block_pool import BlockPool
from memory_service.manager.block_types import AllocateOp, AppendOp, ForkOp, FreeOp, Op, OpResult, ReservedPool
from memory_service.manager.prefix_cache import ROOT_ENTRY_ID, PrefixCache, namespace_key
from memory_service.manager.tier_book import TierBook
from memory_service.manager.chain import chain_hashes, root_hash
from memory_service.token_encoding import TOKEN_WIDTH

NO_QUOTA = 1 << 62  # a client's quota of block-table entries when it has none


@dataclass(slots=True)
class SequenceState:
    """Book-keeping of one live sequence."""

    block_table: list[int]  # len == num_blocks_for(num_tokens, block_size)
    num_tokens: int
    may_use_reserved: bool
    ns_key: bytes  # prefix_cache.namespace_key of its namespace (b"" without prefix caching)
    # With prefix caching: the (encoded) tokens of the last block while it is partially filled, to
    # key it once it fills; and the cache entry id of the content of the last full block.
    partial_token_bytes: bytes
    last_entry_id: int
    # With a tier (its client has a tier identity): the tier key of its last full block (chain.py).
    tier_hash: bytes | None = None


@dataclass(slots=True)
class BatchState:
    """One client's batch while it applies."""

    client_id: str
    seqs: dict[str, SequenceState]  # the client's live sequences
    pending: dict[int, None]  # the client's blocks registered but not committed (ordered set)
    late_free_indices: set[int]
    # Entries of the client's block tables, and the most it may hold (its quota; see BlockManager).
    num_table_blocks: int = 0
    max_table_blocks: int = NO_QUOTA
    failed_seq_ids: set[str] = field(default_factory=set)  # their AllocateOp (or their parent's) failed
    late_block_tables: list[list[int]] = field(default_factory=list)  # freed with tokens this batch writes


class OpApplier:
    """Applies validated ops to the pool and the prefix cache; counts cache queries and copies.

    Args:
        pool: the block pool (refcounts, free lists, LRUs).
        prefix_cache: the content index of full blocks (None: prefix caching disabled).
        block_size: tokens per block.
        reserved: the reserved pool's rule (who may take its blocks).
        copy_block: ``copy_block(src, dst)`` copies a block's bytes (copy-on-write), or None.

    Attributes:
        tier: the book of a tier below the pool (tier_book.py), set by ``BlockManager.enable_tier``.
    """

    tier: TierBook | None = None

    def __init__(
        self,
        pool: BlockPool,
        prefix_cache: PrefixCache | None,
        block_size: int,
        reserved: ReservedPool,
        copy_block: Callable[[int, int], None] | None,
    ) -> None:
        self._pool = pool
        self._ref_counts = pool.ref_counts  # the pool's own list: read here, changed only by the pool
        self._prefix_cache = prefix_cache
        self._block_size = block_size
        self._reserved = reserved
        self._copy_block = copy_block
        self._appliers: dict[type, Callable[[BatchState, int, Op, bytes | None], OpResult]] = {
            AppendOp: self._append,
            AllocateOp: self._allocate,
            FreeOp: self._free,
            ForkOp: self._fork,
        }
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        self.num_copy_on_writes = 0

    def apply(self, batch: BatchState, ops: Sequence[Op], encoded_token_ids: list[bytes | None]) -> list[OpResult]:
        """Applies a validated batch in order, then releases the blocks of its late FreeOps.

        Args:
            batch: the client's state for this batch.
            ops: the ops, validated.
            encoded_token_ids: per op, what the validation encoded (tokens, or None).

        Returns:
            One result per op.
        """
        appliers = self._appliers
        results: list[OpResult] = []
        try:
            for index, (op, token_bytes) in enumerate(zip(ops, encoded_token_ids)):
                results.append(appliers[type(op)](batch, index, op, token_bytes))
        finally:  # also when copy_block raised: the freed sequences are gone, their blocks must not leak
            for block_table in batch.late_block_tables:
                self._pool.release(reversed(block_table))
                batch.num_table_blocks -= len(block_table)
        return results

    def free_sequence(self, seqs: dict[str, SequenceState], seq_id: str) -> None:
        """Forgets a sequence; its blocks lose their reference, tail first.

        Tail first: the tail becomes older in the LRU than the head, and the head ends up on top of
        the free stack.
        """
        self._pool.release(reversed(seqs.pop(seq_id).block_table))

    # --- one applier per op type (validated ops; token_bytes as encoded by the validation) ----

    def _allocate(self, batch: BatchState, index: int, op: AllocateOp, prompt_bytes: bytes) -> OpResult:
        block_size = self._block_size
        num_prompt_tokens = len(prompt_bytes) // TOKEN_WIDTH
        may_use_reserved = self._reserved.admits(op.priority)
        cache = self._prefix_cache
        tier_hashes = tier_root = tier_lookup = None
        if cache is not None:
            ns_key = namespace_key(op.namespace)
            # (Looking at no block finds nothing, in the cache or the tier: the chain of its own
            # blocks starts at the root.)
            max_num_cached_blocks = 0 if op.skip_cache_read else (num_prompt_tokens - 1) // block_size
            block_table, parent_entry_id = cache.match(prompt_bytes, ns_key, max_num_cached_blocks, batch.client_id)
            tier = self.tier
            identity = tier.identities.get(batch.client_id) if tier is not None else None
            if identity is not None:
                block_width = block_size * TOKEN_WIDTH
                tier_root = root_hash(identity, ns_key)
                tier_hashes = chain_hashes(tier_root, prompt_bytes, block_width, num_prompt_tokens // block_size)
                num_pool_blocks = len(block_table)
                if num_pool_blocks < max_num_cached_blocks:
                    # The retry's table must fit the quota (less what the client's loads pin) as a
                    # plain allocation's does: the prefix, the loaded blocks and the blocks of its
                    # first new tokens; any number of blocks when the whole prompt's table fits.
                    quota_left = batch.max_table_blocks - batch.num_table_blocks
                    if num_blocks_for(num_prompt_tokens, block_size) <= quota_left:
                        max_num_load_blocks = max_num_cached_blocks
                    else:
                        max_num_load_blocks = (quota_left - num_pool_blocks
                                               - num_blocks_for(op.max_num_new_tokens, block_size))
                    tier_lookup = tier.start_load(
                        batch.client_id, op.seq_id, tier_hashes, block_table, max_num_cached_blocks,
                        max_num_load_blocks, prompt_bytes, block_width, ns_key, may_use_reserved, self._pool)
                    if tier_lookup.is_loading:
                        batch.failed_seq_ids.add(op.seq_id)  # like a failed allocation: nothing exists yet
                        # Its pins count against the quota for the rest of the batch (and after it,
                        # BlockManager.apply, until the load ends).
                        batch.max_table_blocks -= tier_lookup.num_pinned
                        return OpResult(False, [], loading=True)
        else:
            ns_key, block_table, parent_entry_id = b"", [], ROOT_ENTRY_ID
        num_cached_blocks = len(block_table)
        num_cached_tokens = num_cached_blocks * block_size
        num_new_tokens = min(num_prompt_tokens - num_cached_tokens, op.max_num_new_tokens)
        num_tokens = num_cached_tokens + num_new_tokens
        num_new_blocks = num_blocks_for(num_tokens, block_size) - num_cached_blocks

        pool = self._pool
        if (num_new_blocks > pool.num_available(may_use_reserved, sharing=block_table)
                or batch.num_table_blocks + num_cached_blocks + num_new_blocks > batch.max_table_blocks):
            batch.failed_seq_ids.add(op.seq_id)
            return OpResult(False, [])
        batch.failed_seq_ids.discard(op.seq_id)
        if tier_hashes is not None:  # counted once it got its blocks; a later one may load again
            self.tier.allocated(batch.client_id, op.seq_id, tier_lookup)
        pool.share(block_table)
        block_table += pool.take(num_new_blocks, may_use_reserved)
        batch.num_table_blocks += num_cached_blocks + num_new_blocks
        partial_token_bytes = b""
        if cache is not None:
            num_full_blocks = num_tokens // block_size
            if num_full_blocks > num_cached_blocks:
                parent_entry_id = cache.register(
                    block_table[num_cached_blocks:num_full_blocks],
                    prompt_bytes,
                    num_cached_tokens,
                    ns_key,
                    parent_entry_id,
                    batch.client_id,
                    batch.pending,
                )
                if tier_hashes is not None:
                    new_hashes = tier_hashes[num_cached_blocks:num_full_blocks]
                    parent = tier_hashes[num_cached_blocks - 1] if num_cached_blocks else tier_root
                    _set_tier_hashes(cache, block_table, num_cached_blocks, new_hashes, parent)
            if tier_hashes is not None:
                tier_root = tier_hashes[num_full_blocks - 1] if num_full_blocks else tier_root
            partial_token_bytes = prompt_bytes[num_full_blocks * block_size * TOKEN_WIDTH : num_tokens * TOKEN_WIDTH]
            if not op.skip_cache_read:  # not a lookup: the hit rate counts only those
                self.num_prefix_cache_queries += num_prompt_tokens
                self.num_prefix_cache_hits += num_cached_tokens
        batch.seqs[op.seq_id] = SequenceState(
            block_table, num_tokens, may_use_reserved, ns_key, partial_token_bytes, parent_entry_id, tier_root
        )
        return OpResult(True, list(block_table), num_cached_tokens, num_new_tokens)

    def _append(self, batch: BatchState, index: int, op: AppendOp, token_bytes: bytes) -> OpResult:
        failed = batch.failed_seq_ids
        if failed and op.seq_id in failed:
            return OpResult(False, [])
        seq = batch.seqs[op.seq_id]
        block_size = self._block_size
        block_table = seq.block_table
        num_tokens = seq.num_tokens
        new_num_tokens = num_tokens + len(token_bytes) // TOKEN_WIDTH
        num_new_blocks = num_blocks_for(new_num_tokens, block_size) - len(block_table)
        copies: list[tuple[int, int]] = []
        if num_new_blocks and batch.num_table_blocks + num_new_blocks > batch.max_table_blocks:
            return OpResult(False, [])  # over the client's quota: as out of blocks, nothing changed
        if num_tokens % block_size and self._ref_counts[block_table[-1]] > 1:
            # A partially filled last block shared with a fork would receive this sequence's tokens
            # under the other sequence's feet: give this sequence its own copy first.
            copied = self._copy_on_write(seq, num_new_blocks)
            if copied is None:
                return OpResult(False, [])
            copy, new_block_ids = copied
            copies.append(copy)
        elif num_new_blocks:
            pool = self._pool
            if num_new_blocks > pool.num_available(seq.may_use_reserved):
                return OpResult(False, [])
            new_block_ids = pool.take(num_new_blocks, seq.may_use_reserved)
            block_table += new_block_ids
        else:  # the common decode step: the token fits in the last block
            new_block_ids = []
        seq.num_tokens = new_num_tokens
        batch.num_table_blocks += num_new_blocks  # a copy replaces the entry it copies
        cache = self._prefix_cache
        if cache is not None:
            partial_token_bytes = seq.partial_token_bytes + token_bytes
            num_filled = len(partial_token_bytes) // (block_size * TOKEN_WIDTH)
            if num_filled:
                first = num_tokens // block_size
                seq.last_entry_id = cache.register(
                    block_table[first : first + num_filled],
                    partial_token_bytes,
                    0,
                    seq.ns_key,
                    seq.last_entry_id,
                    batch.client_id,
                    batch.pending,
                )
                if seq.tier_hash is not None:
                    hashes = chain_hashes(seq.tier_hash, partial_token_bytes, block_size * TOKEN_WIDTH, num_filled)
                    _set_tier_hashes(cache, block_table, first, hashes, seq.tier_hash)
                    seq.tier_hash = hashes[-1]
                partial_token_bytes = partial_token_bytes[num_filled * block_size * TOKEN_WIDTH :]
            seq.partial_token_bytes = partial_token_bytes
        return OpResult(True, new_block_ids, 0, 0, copies)

    def _copy_on_write(self, seq: SequenceState, num_new_blocks: int) -> tuple[tuple[int, int], list[int]] | None:
        """Replaces the sequence's shared last block by a copy (taken before the new blocks), then
        appends ``num_new_blocks`` blocks to its table.

        Returns:
            ``(src, dst)``: the shared block given up and its copy, then the blocks appended; None
            when the pool has too few blocks (nothing changed).
        """
        pool = self._pool
        if num_new_blocks + 1 > pool.num_available(seq.may_use_reserved):
            return None
        new_block_ids = pool.take(num_new_blocks + 1, seq.may_use_reserved)
        block_table = seq.block_table
        src, dst = block_table[-1], new_block_ids.pop(0)
        if self._copy_block is not None:
            try:
                self._copy_block(src, dst)
            except BaseException:
                # Give the blocks back (entries evicted for them stay dropped), then re-raise.
                pool.release(reversed([dst, *new_block_ids]))
                raise
        block_table[-1] = dst
        pool.release((src,))  # the other sequences keep it: refcount still >= 1
        self.num_copy_on_writes += 1
        block_table += new_block_ids
        return (src, dst), new_block_ids

    def _free(self, batch: BatchState, index: int, op: FreeOp, _: None) -> OpResult:
        failed = batch.failed_seq_ids
        if failed and op.seq_id in failed:
            if self.tier is not None:  # its AllocateOp answered ``loading`` in this batch, maybe
                self.tier.forget(batch.client_id, op.seq_id)
            return OpResult(False, [])
        if op.seq_id not in batch.seqs:  # parked on a tier load (validated): no blocks, the tier forgets it
            self.tier.forget(batch.client_id, op.seq_id)
            return OpResult(True, [])
        if index not in batch.late_free_indices:
            block_table = batch.seqs[op.seq_id].block_table
            self.free_sequence(batch.seqs, op.seq_id)
            batch.num_table_blocks -= len(block_table)
            return OpResult(True, block_table)
        # Freed in the batch that wrote to it: its blocks outlive the batch, and what it filled in
        # this batch is never published (no later batch of it will acknowledge the write).
        block_table = batch.seqs.pop(op.seq_id).block_table
        pending = batch.pending
        if pending:
            for block_id in block_table:
                if block_id in pending:
                    del pending[block_id]
                    self._prefix_cache.unregister(block_id)
        batch.late_block_tables.append(block_table)
        return OpResult(True, block_table)

    def _fork(self, batch: BatchState, index: int, op: ForkOp, _: None) -> OpResult:
        if op.parent_seq_id in batch.failed_seq_ids:
            batch.failed_seq_ids.add(op.child_seq_id)
            return OpResult(False, [])
        batch.failed_seq_ids.discard(op.child_seq_id)
        parent = batch.seqs[op.parent_seq_id]
        self._pool.share(parent.block_table)
        # Counted, never refused: a fork takes no block (the quota bounds the blocks taken, see
        # BlockManager), and the compute service's scheduler relies on forks succeeding.
        batch.num_table_blocks += len(parent.block_table)
        batch.seqs[op.child_seq_id] = SequenceState(
            list(parent.block_table),
            parent.num_tokens,
            parent.may_use_reserved,
            parent.ns_key,
            parent.partial_token_bytes,  # immutable: shared until either side appends
            parent.last_entry_id,
            parent.tier_hash,
        )
        return OpResult(True, list(parent.block_table))


def _set_tier_hashes(cache: PrefixCache, block_table: list[int], first: int, hashes: list[bytes],
                     parent: bytes) -> None:
    """Gives the tier keys ``hashes`` to the blocks ``block_table[first:]`` that just registered (a
    block whose twin was cached already has no cache key, and gets none); ``parent`` is the key of
    the block before the first."""
    block_keys, tier_hashes, tier_parents = cache.block_keys, cache.tier_hashes, cache.tier_parents
    for block_id, tier_hash in zip(block_table[first : first + len(hashes)], hashes):
        if block_keys[block_id] is not None:
            tier_hashes[block_id] = tier_hash
            tier_parents[block_id] = parent
        parent = tier_hash
