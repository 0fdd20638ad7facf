"""Block manager: which KV blocks each sequence holds (docs/design.md, "Block manager").

Pure Python and single-threaded (the servicer holds a lock around every call). The sequences,
their owners and the ops live here; the state of each block in ``block_pool``, the content index
of full blocks in ``prefix_cache``, the checks of a batch in ``op_validation``.

Ordering rules (tests assert exact block ids against them), on top of ``block_pool``'s:

- A freed sequence releases its blocks tail first: its head is handed out again first, and its
  tail is evicted first.
- A FreeOp of a sequence that an earlier op of the same batch allocated or appended to releases its
  blocks after the batch's last op (in FreeOp order): the K/V of those tokens is written after the
  batch, so its blocks must not serve a later op of the batch.
- Copy-on-write takes its destination before the blocks that the same AppendOp appends.
- ``release_client`` frees the client's sequences in creation order.

Commit before share: blocks that fill in a client's batch are registered in the prefix cache as
*pending* (``prefix_cache``): that client's later ops may share them at once, other clients only
once the client's next batch (or ``commit``) acknowledges that their K/V is written. A client that
frees such a sequence in the same batch, or is released, never publishes them: their entries are
dropped and the blocks go back to the free list, not to the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from memory_service.block_pool import BlockPool
from memory_service.block_types import (
    AllocateOp,
    AppendOp,
    BlockManagerConfig,
    BlockManagerStats,
    ForkOp,
    FreeOp,
    Op,
    OpResult,
    PoolStats,
)
from memory_service.op_validation import OpValidator
from memory_service.prefix_cache import ROOT_ENTRY_ID, PrefixCache, namespace_key
from memory_service.token_encoding import TOKEN_WIDTH

__all__ = [
    "AllocateOp",
    "AppendOp",
    "BlockManager",
    "BlockManagerConfig",
    "BlockManagerStats",
    "ForkOp",
    "FreeOp",
    "Op",
    "OpResult",
    "PoolStats",
]


@dataclass(slots=True)
class _Sequence:
    """Book-keeping of one live sequence."""

    block_table: list[int]  # len == ceil(num_tokens / block_size)
    num_tokens: int
    may_use_reserved: bool
    ns_key: bytes  # prefix_cache.namespace_key of its namespace (b"" without prefix caching)
    # With prefix caching: the (encoded) tokens of the last block while it is partially filled, to
    # key it once it fills; and the cache entry id of the content of the last full block.
    partial_token_bytes: bytes
    last_entry_id: int


@dataclass(slots=True)
class _Batch:
    """One client's batch while it applies."""

    client_id: str
    seqs: dict[str, _Sequence]  # the client's live sequences
    pending: dict[int, None]  # the client's blocks registered but not committed (ordered set)
    late_free_indices: set[int]
    failed_seq_ids: set[str] = field(default_factory=set)  # their AllocateOp (or their parent's) failed
    late_block_tables: list[list[int]] = field(default_factory=list)  # freed with tokens this batch writes


class BlockManager:
    """Allocates, shares, caches and frees the blocks of a paged KV pool.

    Out of blocks is a normal result (``OpResult.ok == False``, and that op changed nothing); bad
    input raises ``ValueError`` and changes nothing; a broken invariant raises ``AssertionError``.
    Sequence ids are per client: two clients may use the same id for different sequences.

    Args:
        config: pool geometry and policies.
        copy_block: ``copy_block(src, dst)`` copies a block's bytes in the pool, in every layer
            (copy-on-write). None when there are no bytes to copy (tests, benchmarks); copies are
            reported all the same.
    """

    def __init__(self, config: BlockManagerConfig, copy_block: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        self._block_size = config.block_size
        self._reserved_min_priority = config.reserved_min_priority
        self._copy_block = copy_block
        self._prefix_cache = PrefixCache(config.num_blocks, config.block_size) if config.enable_prefix_caching else None
        self._pool = BlockPool(config.num_blocks, config.num_general_blocks, self._prefix_cache)
        # client_id -> its live sequences, in creation order (release frees them in that order).
        self._client_seqs: dict[str, dict[str, _Sequence]] = {}
        self._pending: dict[str, dict[int, None]] = {}  # client_id -> its uncommitted cache blocks
        self._validator = OpValidator(config.num_blocks * config.block_size, self._client_seqs)
        self._appliers: dict[type, Callable[[_Batch, int, Op, bytes | None], OpResult]] = {
            AppendOp: self._apply_append,
            AllocateOp: self._apply_allocate,
            FreeOp: self._apply_free,
            ForkOp: self._apply_fork,
        }
        self._num_prefix_cache_queries = 0
        self._num_prefix_cache_hits = 0
        self._num_copy_on_writes = 0

    # --- clients ----------------------------------------------------------------------------

    def add_client(self, client_id: str) -> None:
        """Registers a client (a lease) that may own sequences.

        Args:
            client_id: a new, non-empty id.
        """
        if type(client_id) is not str or not client_id:
            raise ValueError(f"client_id must be a non-empty string, got {client_id!r}")
        if client_id in self._client_seqs:
            raise ValueError(f"client_id {client_id!r} is already attached")
        self._client_seqs[client_id] = {}
        self._pending[client_id] = {}

    def release_client(self, client_id: str) -> int:
        """Ends a client's lease: frees all its sequences and forgets it.

        Committed cached blocks stay cached; blocks it never committed are dropped from the cache
        (their K/V may never have been written).

        Args:
            client_id: an attached client.

        Returns:
            The number of sequences freed.
        """
        seqs = self._client_seqs.get(client_id)
        if seqs is None:
            raise ValueError(f"client_id {client_id!r} is not attached")
        for block_id in self._pending.pop(client_id):
            self._prefix_cache.unregister(block_id)
        num_freed = len(seqs)
        for seq_id in list(seqs):
            self._free(seqs, seq_id)
        del self._client_seqs[client_id]
        return num_freed

    def commit(self, client_id: str) -> None:
        """Publishes the blocks a client filled so far: their K/V is written, other clients may share them.

        Every ``apply`` of the client commits its earlier batches first; this is for a client that
        has nothing more to send.

        Args:
            client_id: an attached client.
        """
        pending = self._pending.get(client_id)
        if pending is None:
            raise ValueError(f"client_id {client_id!r} is not attached")
        if pending:
            self._prefix_cache.commit(pending)
            pending.clear()

    def has_client(self, client_id: str) -> bool:
        """Tells whether a client is attached.

        Args:
            client_id: any id.

        Returns:
            True between ``add_client`` and ``release_client``.
        """
        return client_id in self._client_seqs

    def has_sequence(self, client_id: str, seq_id: str) -> bool:
        """Tells whether a client has a live sequence of this id.

        Args:
            client_id: any id.
            seq_id: any id.

        Returns:
            True between its AllocateOp or ForkOp and its FreeOp (or its client's release).
        """
        return seq_id in self._client_seqs.get(client_id, ())

    # --- ops ----------------------------------------------------------------------------------

    def apply(self, client_id: str, ops: Sequence[Op]) -> list[OpResult]:
        """Applies a batch of ops of one client (one scheduler step), in order.

        All ops are validated first, against the state as the earlier ops would leave it; a bad one
        raises ``ValueError`` and nothing is applied. A valid batch first commits the client's
        earlier batches (it acknowledges that their K/V is written). Then each op applies
        atomically: one that finds too few blocks returns ``ok=False`` having changed nothing, and
        the others still apply. Ops on a sequence whose AllocateOp failed earlier in the batch (or
        a fork of it) fail the same way. A sequence forked after its AllocateOp/AppendOp in the
        batch takes no more AppendOps in that batch, nor does its child (see ``OpValidator``). A
        sequence freed after its AllocateOp/AppendOp in the batch keeps its blocks until the batch
        ends: the K/V of its new tokens is written after the batch all the same, and would
        overwrite whatever a later op put in them (a copy-on-write destination is copied when its
        op applies); the blocks it filled in the batch are never published.

        Args:
            client_id: an attached client.
            ops: AllocateOp, AppendOp, FreeOp and ForkOp, in any mix.

        Returns:
            One result per op, in order.
        """
        encoded_token_ids, late_free_indices = self._validator.validate(client_id, ops)
        self.commit(client_id)
        batch = _Batch(client_id, self._client_seqs[client_id], self._pending[client_id], late_free_indices)
        appliers = self._appliers
        results: list[OpResult] = []
        try:
            for index, (op, token_bytes) in enumerate(zip(ops, encoded_token_ids)):
                results.append(appliers[type(op)](batch, index, op, token_bytes))
        finally:  # also when copy_block raised: the freed sequences are gone, their blocks must not leak
            for block_table in batch.late_block_tables:
                self._pool.release(reversed(block_table))
        return results

    def allocate(self, client_id: str, op: AllocateOp) -> OpResult:
        """Creates a sequence: shares its cached prefix, then takes blocks for its next tokens.

        The prefix match takes full cached blocks only (committed ones, or this client's own) and
        always leaves at least one prompt token to compute (the model must run the last prompt
        token to sample), so it covers at most ``(len(prompt) - 1) // block_size`` blocks. New
        blocks then cover ``min(len(prompt) - num_cached_tokens, max_num_new_tokens)`` more tokens;
        the ones that are full get registered in the prefix cache, pending.

        Args:
            client_id: the owner.
            op: the allocation.

        Returns:
            ``block_ids`` = the whole table, ``num_cached_tokens``, ``num_new_tokens``; or ``ok=False``.
        """
        return self._apply_one(client_id, op, AllocateOp)

    def append(self, client_id: str, op: AppendOp) -> OpResult:
        """Grows a sequence by tokens whose K/V is written in this step.

        Takes blocks as needed. When the last block is partially filled and shared (after a fork),
        this sequence first gets a copy of it (copy-on-write), since the new tokens go into it.
        Blocks that become full get registered in the prefix cache, pending.

        Args:
            client_id: the owner.
            op: the sequence and its new tokens.

        Returns:
            ``block_ids`` = the blocks appended to the table, ``copies`` = ``[(src, dst)]`` when a
            copy replaced the last block; or ``ok=False``.
        """
        return self._apply_one(client_id, op, AppendOp)

    def free(self, client_id: str, op: FreeOp) -> OpResult:
        """Ends a sequence. Its blocks lose a reference; unreferenced ones that hold a cache key become
        evictable (LRU, tail first), the others free.

        Args:
            client_id: the owner.
            op: the sequence.

        Returns:
            ``block_ids`` = the table the sequence held.
        """
        return self._apply_one(client_id, op, FreeOp)

    def fork(self, client_id: str, op: ForkOp) -> OpResult:
        """Creates a child sequence sharing every block of its parent (no copy until one appends).

        Args:
            client_id: the owner of the parent, and of the child.
            op: parent and child ids.

        Returns:
            ``block_ids`` = the child's table.
        """
        return self._apply_one(client_id, op, ForkOp)

    def block_table(self, client_id: str, seq_id: str) -> list[int]:
        """Returns a copy of a live sequence's block table.

        Args:
            client_id: the owner.
            seq_id: a live sequence of that client.

        Returns:
            Block ids; token ``p`` lives in block ``table[p // block_size]``.
        """
        seq = self._client_seqs.get(client_id, {}).get(seq_id)
        if seq is None:
            raise ValueError(f"seq_id {seq_id!r} is not a live sequence of this client")
        return list(seq.block_table)

    def ref_count(self, block_id: int) -> int:
        """Tells how many block tables hold a block.

        Args:
            block_id: a block id in ``[0, num_blocks)``.

        Returns:
            The block's reference count; 0 when it is free or evictable.
        """
        if type(block_id) is not int or not 0 <= block_id < self.config.num_blocks:
            raise ValueError(f"block_id must be an int in [0, {self.config.num_blocks}), got {block_id!r}")
        return self._pool.ref_counts[block_id]

    def num_available_blocks(self) -> tuple[int, int]:
        """Tells how many blocks allocation can still take, per pool: free plus evictable cached ones.

        Returns:
            (general pool, reserved pool); O(1), cheap enough to answer every step.
        """
        return self._pool.num_available_blocks()

    # --- one applier per op type (validated ops; token_bytes as encoded by the validation) ----

    def _apply_one(self, client_id: str, op: Op, op_type: type) -> OpResult:
        if type(op) is not op_type:
            raise ValueError(f"expected an {op_type.__name__}, got {type(op).__name__}")
        return self.apply(client_id, (op,))[0]

    def _apply_append(self, batch: _Batch, index: int, op: AppendOp, token_bytes: bytes) -> OpResult:
        if op.seq_id in batch.failed_seq_ids:
            return OpResult(False, [])
        return self._append(batch, batch.seqs[op.seq_id], token_bytes)

    def _apply_allocate(self, batch: _Batch, index: int, op: AllocateOp, prompt_bytes: bytes) -> OpResult:
        result = self._allocate(batch, op, prompt_bytes)
        if result.ok:
            batch.failed_seq_ids.discard(op.seq_id)
        else:
            batch.failed_seq_ids.add(op.seq_id)
        return result

    def _apply_free(self, batch: _Batch, index: int, op: FreeOp, _: None) -> OpResult:
        if op.seq_id in batch.failed_seq_ids:
            return OpResult(False, [])
        if index not in batch.late_free_indices:
            return OpResult(True, self._free(batch.seqs, op.seq_id))
        # Freed in the batch that wrote to it: its blocks outlive the batch, and what it filled in
        # this batch is never published (no later batch of it will acknowledge the write).
        block_table = self._free(batch.seqs, op.seq_id, release=False)
        pending = batch.pending
        if pending:
            for block_id in block_table:
                if block_id in pending:
                    del pending[block_id]
                    self._prefix_cache.unregister(block_id)
        batch.late_block_tables.append(block_table)
        return OpResult(True, block_table)

    def _apply_fork(self, batch: _Batch, index: int, op: ForkOp, _: None) -> OpResult:
        if op.parent_seq_id in batch.failed_seq_ids:
            batch.failed_seq_ids.add(op.child_seq_id)
            return OpResult(False, [])
        batch.failed_seq_ids.discard(op.child_seq_id)
        parent = batch.seqs[op.parent_seq_id]
        self._pool.share(parent.block_table)
        batch.seqs[op.child_seq_id] = _Sequence(
            list(parent.block_table),
            parent.num_tokens,
            parent.may_use_reserved,
            parent.ns_key,
            parent.partial_token_bytes,  # immutable: shared until either side appends
            parent.last_entry_id,
        )
        return OpResult(True, list(parent.block_table))

    def _allocate(self, batch: _Batch, op: AllocateOp, prompt_bytes: bytes) -> OpResult:
        block_size = self._block_size
        num_prompt_tokens = len(prompt_bytes) // TOKEN_WIDTH
        may_use_reserved = op.priority >= self._reserved_min_priority
        cache = self._prefix_cache
        if cache is not None:
            ns_key = namespace_key(op.namespace)
            block_table, parent_entry_id = cache.match(
                prompt_bytes, ns_key, (num_prompt_tokens - 1) // block_size, batch.client_id
            )
        else:
            ns_key, block_table, parent_entry_id = b"", [], ROOT_ENTRY_ID
        num_cached_blocks = len(block_table)
        num_cached_tokens = num_cached_blocks * block_size
        num_new_tokens = min(num_prompt_tokens - num_cached_tokens, op.max_num_new_tokens)
        num_tokens = num_cached_tokens + num_new_tokens
        num_new_blocks = -(-num_tokens // block_size) - num_cached_blocks

        pool = self._pool
        if num_new_blocks > pool.num_available(may_use_reserved, sharing=block_table):
            return OpResult(False, [])
        pool.share(block_table)
        block_table += pool.take(num_new_blocks, may_use_reserved)
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
            partial_token_bytes = prompt_bytes[num_full_blocks * block_size * TOKEN_WIDTH : num_tokens * TOKEN_WIDTH]
            self._num_prefix_cache_queries += num_prompt_tokens
            self._num_prefix_cache_hits += num_cached_tokens
        batch.seqs[op.seq_id] = _Sequence(
            block_table, num_tokens, may_use_reserved, ns_key, partial_token_bytes, parent_entry_id
        )
        return OpResult(True, list(block_table), num_cached_tokens, num_new_tokens)

    def _append(self, batch: _Batch, seq: _Sequence, token_bytes: bytes) -> OpResult:
        block_size = self._block_size
        block_table = seq.block_table
        num_tokens = seq.num_tokens
        new_num_tokens = num_tokens + len(token_bytes) // TOKEN_WIDTH
        # A partially filled last block shared with a fork would receive this sequence's tokens under
        # the other sequence's feet: give this sequence its own copy first.
        pool = self._pool
        needs_copy = num_tokens % block_size != 0 and pool.ref_counts[block_table[-1]] > 1
        num_new_blocks = -(-new_num_tokens // block_size) - len(block_table) + needs_copy
        new_block_ids: list[int] = []
        copies: list[tuple[int, int]] = []
        if num_new_blocks:
            if num_new_blocks > pool.num_available(seq.may_use_reserved):
                return OpResult(False, [])
            new_block_ids = pool.take(num_new_blocks, seq.may_use_reserved)
            if needs_copy:
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
                copies.append((src, dst))
                self._num_copy_on_writes += 1
            block_table += new_block_ids
        seq.num_tokens = new_num_tokens
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
                partial_token_bytes = partial_token_bytes[num_filled * block_size * TOKEN_WIDTH :]
            seq.partial_token_bytes = partial_token_bytes
        return OpResult(True, new_block_ids, 0, 0, copies)

    def _free(self, seqs: dict[str, _Sequence], seq_id: str, release: bool = True) -> list[int]:
        """Forgets a sequence and returns its table; its blocks lose their reference now if ``release``,
        else the caller releases them later."""
        seq = seqs.pop(seq_id)
        if release:
            # Tail first: the tail becomes older in the LRU than the head, and the head ends up on
            # top of the free stack.
            self._pool.release(reversed(seq.block_table))
        return seq.block_table

    # --- observability ------------------------------------------------------------------------

    def stats(self) -> BlockManagerStats:
        """Returns a snapshot: block counts per pool, utilization, prefix-cache and event counters.

        Returns:
            The stats; O(blocks in use), not for the hot path.
        """
        block_size = self._block_size
        num_filled: dict[int, int] = {}  # used block -> tokens it holds (the most any table stores in it)
        for seq in (seq for seqs in self._client_seqs.values() for seq in seqs.values()):
            table = seq.block_table
            for block_id in table[:-1]:
                num_filled[block_id] = block_size
            last = seq.num_tokens - (len(table) - 1) * block_size
            if num_filled.get(table[-1], 0) < last:
                num_filled[table[-1]] = last
        num_slots = len(num_filled) * block_size
        num_stored = sum(num_filled.values())
        return BlockManagerStats(
            pools=self._pool.stats(),
            kv_utilization=num_stored / num_slots if num_slots else 0.0,
            fragmentation=(num_slots - num_stored) / num_slots if num_slots else 0.0,
            prefix_cache_queries=self._num_prefix_cache_queries,
            prefix_cache_hits=self._num_prefix_cache_hits,
            num_evictions=self._pool.num_evictions,
            num_copy_on_writes=self._num_copy_on_writes,
            num_sequences=sum(map(len, self._client_seqs.values())),
            num_clients=len(self._client_seqs),
            block_size=block_size,
        )

    def check_integrity(self) -> None:
        """Checks every invariant; O(pool size), for tests and debugging.

        Checked: each block is free, cached or used; per pool ``free + cached + used == total``;
        refcount == number of block tables holding the block; free blocks have no cache key,
        evictable ones have one; the prefix cache's keys are unique and consistent; each table
        fits its sequence's token count; a pending block is referenced, and listed by exactly the client
        that owns it.

        Raises:
            AssertionError: naming the first broken invariant (a bug, never bad input).
        """
        block_size, num_blocks = self._block_size, self.config.num_blocks
        expected_ref_counts = [0] * num_blocks
        for client_id, seqs in self._client_seqs.items():
            for seq_id, seq in seqs.items():
                table = seq.block_table
                if seq.num_tokens < 1 or len(table) != -(-seq.num_tokens // block_size):
                    raise AssertionError(f"seq {seq_id!r}: {len(table)} blocks for {seq.num_tokens} tokens")
                if len(set(table)) != len(table) or not all(0 <= b < num_blocks for b in table):
                    raise AssertionError(f"seq {seq_id!r}: bad block table {table}")
                num_partial = len(seq.partial_token_bytes) // TOKEN_WIDTH
                if self._prefix_cache is not None and num_partial != seq.num_tokens % block_size:
                    raise AssertionError(f"seq {seq_id!r}: {num_partial} pending tokens for {seq.num_tokens}")
                for block_id in table:
                    expected_ref_counts[block_id] += 1
        if self._pending.keys() != self._client_seqs.keys():
            raise AssertionError("the clients with pending blocks are not the attached ones")
        self._pool.check_integrity(expected_ref_counts)
        if self._prefix_cache is not None:
            owners = self._prefix_cache.pending_owners
            num_pending = sum(map(len, self._pending.values()))
            if num_pending != sum(owner is not None for owner in owners):
                raise AssertionError(f"{num_pending} pending blocks listed, but the cache marks others")
            for client_id, pending in self._pending.items():
                for block_id in pending:
                    if owners[block_id] != client_id or not expected_ref_counts[block_id]:
                        raise AssertionError(f"pending block {block_id} of {client_id!r}: wrong owner or unreferenced")
