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

Quotas: a client may be capped (``add_client(max_blocks=N)``) at N block-table entries over its live
sequences. An AllocateOp or AppendOp that would take the client past N fails like one that finds too
few blocks (``ok=False``, nothing changed), so a client cannot hold the pool whatever it sends. The
count is of table entries, not distinct blocks, because it is exact and O(1) to keep: a block two
of the client's sequences share counts twice. A ForkOp is counted but never refused (it takes no
block, and the compute service's scheduler relies on forks succeeding), so the blocks a client
holds never exceed N, though its entries may. The blocks a tier load pins for the client count
against N too until the load ends (``tier_book``'s module docstring, "Quotas").

Commit before share: blocks that fill in a client's batch are registered in the prefix cache as
*pending* (``prefix_cache``): that client's later ops may share them at once, other clients only
once the client's next batch (or ``commit``) acknowledges that their K/V is written. A client that
frees such a sequence in the same batch, or is released, never publishes them: their entries are
dropped and the blocks go back to the free list, not to the cache.

A tier below the pool (``enable_tier``; the book in ``tier_book``, the IO in ``memory_service/tier``):
committed blocks of clients with a tier identity are queued for write-behind, and an AllocateOp
whose cached prefix continues in the tier answers ``loading`` while its blocks are loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.errors import InvalidArgument, echo

from memory_service.manager import manager_checks
from memory_service.manager.block_pool import BlockPool
from memory_service.manager.chain import BlockOrigin, root_hash
from memory_service.manager.block_types import (
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
from memory_service.manager.kv_events import KvEventLog
from memory_service.manager.op_apply import NO_QUOTA, BatchState, OpApplier, SequenceState
from memory_service.manager.op_validation import OpValidator
from memory_service.manager.prefix_cache import ROOT_ENTRY_ID, PrefixCache
from memory_service.manager.tier_book import TierBook, TierDirectory, TierLoad

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


class BlockManager:
    """Allocates, shares, caches and frees the blocks of a paged KV pool.

    Out of blocks is a normal result (``OpResult.ok == False``, and that op changed nothing); bad
    input raises ``InvalidArgument`` and changes nothing; a broken invariant raises ``AssertionError``.
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
        self._prefix_cache = PrefixCache(config.num_blocks, config.block_size) if config.enable_prefix_caching else None
        self._pool = BlockPool(config.num_blocks, config.num_general_blocks, self._prefix_cache)
        # client_id -> its live sequences, in creation order (release frees them in that order).
        self._client_seqs: dict[str, dict[str, SequenceState]] = {}
        self._pending: dict[str, dict[int, None]] = {}  # client_id -> its uncommitted cache blocks
        self._num_table_blocks: dict[str, int] = {}  # client_id -> entries of its block tables
        self._max_table_blocks: dict[str, int] = {}  # client_id -> its quota of such entries
        self._validator = OpValidator(config.num_blocks * config.block_size, self._client_seqs, self._is_parked)
        self._applier = OpApplier(
            self._pool, self._prefix_cache, config.block_size, config.reserved_pool, copy_block
        )
        self._tier: TierBook | None = None

    # --- clients ----------------------------------------------------------------------------

    def enable_tier(self, directory: TierDirectory) -> TierBook:
        """Puts a tier below the pool (tier_book.py): clients added from now on with a tier identity
        use it. Needs prefix caching.

        Args:
            directory: the tier's index and cost estimate.

        Returns:
            The book the tier's worker threads take their work from.
        """
        if self._prefix_cache is None:
            raise ValueError("a tier below the pool needs prefix caching")
        self._tier = self._applier.tier = TierBook(directory)
        for client_id in self._client_seqs:
            self._tier.add_client(client_id, None)
        return self._tier

    def send_kv_events(self, events: KvEventLog) -> None:
        """Tells ``events`` of every block committed or evicted from now on (kv_events.py); without
        prefix caching no block is ever shared, so there is nothing to tell."""
        if self._prefix_cache is not None:
            self._prefix_cache.events = events

    def add_client(self, client_id: str, max_blocks: int | None = None, tier_identity: bytes | None = None) -> None:
        """Registers a client (a lease) that may own sequences.

        Args:
            client_id: a new, non-empty id.
            max_blocks: the client's quota of block-table entries (see the module docstring);
                None: no quota beyond the pool.
            tier_identity: ``TierIdentity.digest`` of its model and layout when it uses the tier
                (only trusted clients may: their committed blocks are persisted); None otherwise.
        """
        if type(client_id) is not str or not client_id:
            raise InvalidArgument(f"client_id must be a non-empty string, got {echo(client_id)}")
        if client_id in self._client_seqs:
            raise InvalidArgument(f"client_id {echo(client_id)} is already attached")
        if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 0):
            raise InvalidArgument(f"max_blocks must be an int >= 0 or None, got {echo(max_blocks)}")
        self._client_seqs[client_id] = {}
        self._pending[client_id] = {}
        self._num_table_blocks[client_id] = 0
        # No quota: a bound no count reaches (forks may list the pool's blocks many times over).
        self._max_table_blocks[client_id] = NO_QUOTA if max_blocks is None else max_blocks
        if self._tier is not None:
            self._tier.add_client(client_id, tier_identity)

    def num_sequences_of(self, client_id: str) -> int:
        """The live sequences ``client_id`` holds (0 for a client not attached)."""
        return len(self._client_seqs.get(client_id, ()))

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
            raise InvalidArgument(f"client_id {echo(client_id)} is not attached")
        for block_id in self._pending.pop(client_id):
            self._prefix_cache.unregister(block_id)
        num_freed = len(seqs)
        for seq_id in list(seqs):
            self._applier.free_sequence(seqs, seq_id)
        del self._client_seqs[client_id]
        del self._num_table_blocks[client_id]
        del self._max_table_blocks[client_id]
        if self._tier is not None:
            self._tier.release_client(client_id)
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
            raise InvalidArgument(f"client_id {echo(client_id)} is not attached")
        if pending:
            self._prefix_cache.commit(pending)
            if self._tier is not None:
                tier_hashes, to_persist = self._prefix_cache.tier_hashes, self._tier.to_persist
                generations = self._pool.generations
                for block_id in pending:
                    if tier_hashes[block_id] is not None:
                        if block_id in to_persist:  # evicted and filled again before the writer came
                            self._tier.num_missed += 1
                        to_persist[block_id] = (tier_hashes[block_id], generations[block_id])
            pending.clear()

    def has_client(self, client_id: str) -> bool:
        """Tells whether a client is attached.

        Args:
            client_id: any id.

        Returns:
            True between ``add_client`` and ``release_client``.
        """
        return client_id in self._client_seqs

    def num_quota_left(self, client_id: str) -> int:
        """Tells how many more block-table entries a client's quota allows.

        Args:
            client_id: an attached client.

        Returns:
            Its quota minus its entries and the blocks its tier loads pin (negative after forks past
            it; see the module docstring).
        """
        return self._max_table_blocks[client_id] - self._num_table_blocks[client_id] - self._num_pinned(client_id)

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
        raises ``InvalidArgument`` and nothing is applied. A valid batch first commits the client's
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
        if self._prefix_cache is not None and self._prefix_cache.events is not None:
            self._prefix_cache.events.note_namespaces(op.namespace for op in ops if type(op) is AllocateOp)
        self.commit(client_id)
        batch = BatchState(client_id, self._client_seqs[client_id], self._pending[client_id], late_free_indices,
                           self._num_table_blocks[client_id],
                           self._max_table_blocks[client_id] - self._num_pinned(client_id))
        try:
            return self._applier.apply(batch, ops, encoded_token_ids)
        finally:  # the ops applied before a copy_block failure count too
            self._num_table_blocks[client_id] = batch.num_table_blocks

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
            raise InvalidArgument(f"seq_id {echo(seq_id)} is not a live sequence of this client")
        return list(seq.block_table)

    def ref_count(self, block_id: int) -> int:
        """Tells how many block tables hold a block.

        Args:
            block_id: a block id in ``[0, num_blocks)``.

        Returns:
            The block's reference count; 0 when it is free or evictable.
        """
        if type(block_id) is not int or not 0 <= block_id < self.config.num_blocks:
            raise InvalidArgument(f"block_id must be an int in [0, {self.config.num_blocks}), got {echo(block_id)}")
        return self._pool.ref_counts[block_id]

    def num_available_blocks(self) -> tuple[int, int]:
        """Tells how many blocks allocation can still take, per pool: free plus evictable cached ones.

        Returns:
            (general pool, reserved pool); O(1), cheap enough to answer every step.
        """
        return self._pool.num_available_blocks()

    # --- the tier (tier_book.py) -------------------------------------------------------------

    def set_prefill_speed(self, client_id: str, prefill_tokens_per_s: float) -> None:
        """Records the client's measured prefill speed (0 = unknown): loads are weighed against it."""
        if self._tier is not None and client_id in self._client_seqs:
            self._tier.prefill_speeds[client_id] = prefill_tokens_per_s

    def take_tier_writes(self, max_blocks: int) -> list[tuple[int, bytes, bytes, int, BlockOrigin]]:
        """The oldest committed blocks waiting for write-behind that still hold their content.

        Args:
            max_blocks: at most this many.

        Returns:
            ``(block_id, tier key, namespace key, generation, origin)`` each (the origin for the IO
            tiers' files: chain.py's ``BlockOrigin``). The caller copies their bytes
            without the manager's lock, then asks ``is_unchanged`` under it: a block evicted and
            handed out meanwhile may have been rewritten, and its copy is dropped (counted missed).

        A block counts as holding its content only while its generation is the one it had when it
        was committed: a block evicted, handed out and taken again for the same tokens carries the
        same key, but its bytes are being rewritten (pending again) or were rewritten by whoever
        held it between; the key alone would let the writer persist them under that key.
        """
        if self._tier is None:
            return []
        to_persist, cache, generations = self._tier.to_persist, self._prefix_cache, self._pool.generations
        writes: list[tuple[int, bytes, bytes, int, BlockOrigin]] = []
        while to_persist and len(writes) < max_blocks:
            block_id = next(iter(to_persist))
            tier_hash, generation = to_persist.pop(block_id)
            if generations[block_id] == generation and cache.tier_hashes[block_id] == tier_hash:
                _, token_bytes, ns_key = cache.block_keys[block_id]
                origin = BlockOrigin(cache.tier_parents[block_id], token_bytes)
                writes.append((block_id, tier_hash, ns_key, generation, origin))
            else:  # evicted (and maybe handed out again) before the writer came
                self._tier.num_missed += 1
        return writes

    def is_unchanged(self, block_id: int, generation: int) -> bool:
        """Whether the block was not handed out since it was committed at ``generation`` (what
        ``take_tier_writes`` returned): its bytes are still the committed ones (``BlockPool.generations``).
        Counts a changed one missed."""
        if self._pool.generations[block_id] == generation:
            return True
        self._tier.num_missed += 1
        return False

    @property
    def num_tier_writes_missed(self) -> int:
        """Committed blocks evicted before the tier's writer copied them: not kept (``TierBook``)."""
        return self._tier.num_missed if self._tier is not None else 0

    def take_new_loads(self) -> list[TierLoad]:
        """Loads started since the last call, for the loader thread."""
        return self._tier.take_new_loads() if self._tier is not None else []

    def take_load_reports(self, client_id: str) -> list[str]:
        """The client's sequences whose load ended since it last asked: it retries their AllocateOp."""
        return self._tier.take_reports(client_id) if self._tier is not None else []

    def finish_load(self, load: TierLoad, num_loaded: int) -> None:
        """Ends a load: its first ``num_loaded`` blocks hold their tier bytes now.

        They register as committed cache entries after the pinned prefix (a block whose twin got
        cached meanwhile stays unregistered and goes back to the free list), then every pin drops,
        tail first, so they join the LRU's young end for the client's retried AllocateOp.

        Args:
            load: a load of ``take_new_loads``.
            num_loaded: how many of its blocks, from the first, were loaded (0: it failed).
        """
        cache, prefix = self._prefix_cache, load.prefix_block_ids
        if num_loaded and (not prefix or cache.block_keys[prefix[-1]] is not None):
            parent_entry_id = cache.entry_ids[prefix[-1]] if prefix else ROOT_ENTRY_ID
            loaded: dict[int, None] = {}
            block_ids = load.block_ids[:num_loaded]
            cache.register(block_ids, load.token_bytes, 0, load.ns_key, parent_entry_id, load.client_id, loaded)
            directory, to_persist = self._tier.directory, self._tier.to_persist
            identity = self._tier.identities.get(load.client_id)
            # The key before the first loaded block: its cached prefix's, else the namespace's root
            # (b"" when neither is known any more: the origin is then not believed, chain.py).
            parent = (cache.tier_hashes[prefix[-1]] or b"") if prefix else (
                root_hash(identity, load.ns_key) if identity is not None else b"")
            for block_id, tier_hash in zip(block_ids, load.hashes):
                if block_id in loaded:
                    cache.tier_hashes[block_id] = tier_hash
                    cache.tier_parents[block_id] = parent
                    if directory.needs_write(tier_hash):  # loaded from RAM, not on disk (yet): written now
                        to_persist[block_id] = (tier_hash, self._pool.generations[block_id])
                parent = tier_hash
            cache.commit(loaded)  # with their tier keys set: KV events follow their tier copies too
        self._pool.release(reversed([*prefix, *load.block_ids]))
        self._tier.end_load(load)

    def _is_parked(self, client_id: str, seq_id: str) -> bool:
        """Whether the client's sequence waits for its tier load or its retry (``TierBook.is_parked``)."""
        return self._tier is not None and self._tier.is_parked(client_id, seq_id)

    def _num_pinned(self, client_id: str) -> int:
        """Blocks the client's tier loads in flight pin (its quota counts them)."""
        return self._tier.num_pinned.get(client_id, 0) if self._tier is not None else 0

    def _apply_one(self, client_id: str, op: Op, op_type: type) -> OpResult:
        if type(op) is not op_type:
            raise InvalidArgument(f"expected an {op_type.__name__}, got {type(op).__name__}")
        return self.apply(client_id, (op,))[0]

    # --- observability ------------------------------------------------------------------------

    def stats(self) -> BlockManagerStats:
        """Returns a snapshot: block counts per pool, utilization, prefix-cache and event counters.

        Returns:
            The stats; O(blocks in use), not for the hot path.
        """
        return manager_checks.collect_stats(self._client_seqs, self._pool, self._applier, self._block_size)

    def check_integrity(self) -> None:
        """Checks every invariant; O(pool size), for tests and debugging.

        Checked: each block is free, cached or used; per pool ``free + cached + used == total``;
        refcount == number of block tables holding the block; free blocks have no cache key,
        evictable ones have one; the prefix cache's keys are unique and consistent; each table
        fits its sequence's token count; a pending block is referenced, and listed by exactly the client
        that owns it; each client's count of block-table entries (its quota's) is the sum of its tables,
        and its count of blocks its tier loads pin is theirs.

        Raises:
            AssertionError: naming the first broken invariant (a bug, never bad input).
        """
        manager_checks.check_integrity(
            self._client_seqs, self._pending, self._pool, self._prefix_cache, self._block_size,
            self._tier.pinned_block_ids() if self._tier is not None else (),
        )
        for client_id, seqs in self._client_seqs.items():
            num_entries = sum(len(seq.block_table) for seq in seqs.values())
            assert self._num_table_blocks[client_id] == num_entries, (
                f"client {client_id!r} is counted {self._num_table_blocks[client_id]} block-table entries, "
                f"holds {num_entries}")
            if self._tier is not None:
                num_pinned = sum(len(load.prefix_block_ids) + len(load.block_ids)
                                 for load in self._tier.loads.values() if load.client_id == client_id)
                assert self._num_pinned(client_id) == num_pinned, (
                    f"client {client_id!r} is counted {self._num_pinned(client_id)} blocks pinned by its tier "
                    f"loads, they pin {num_pinned}")
