"""The memory service's core: one block manager, the lock around it, its tiers and its KV events.

Both allocators stand on it: the gRPC servicer (service/servicer.py) converts a Step to ops, calls
``MemoryCore.step`` and converts the ``StepResult`` back; ``InProcessAllocator`` (in_process.py) calls
it directly. So a step means the same in both: the same validation, the same counts clipped by the
client's quota, the same tier loads. Nothing here sees protobuf, a lease or a token: who may call,
and with which quota, is the servicer's business; the core applies what it is told.

Locking: the block manager is single-threaded by design. ``lock`` serialises its callers (the
servicer's event loop, the metrics thread's ``stats()``, the tiers' writer and loader threads); each
block-manager call under it is short and never waits on I/O.

Tiers: opened once, bound to one model and pool layout (``TierIdentity``), by ``open_tiers``; their
threads copy blocks with torch, so the tier modules are imported there and not before (a service
without a tier never pays for torch's import). ``close_tiers`` stops them before the pool goes: after
it, ``open_tiers`` refuses, so no thread starts over a pool being freed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedserve.errors import InvalidArgument, UnavailableError

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.block_types import BlockManagerConfig, BlockManagerStats, Op, StepResult
from memory_service.manager.chain import BlockOrigin, root_hash
from memory_service.manager.kv_events import KvEventLog

if TYPE_CHECKING:
    import torch

    from memory_service.manager.tier_book import TierLoad
    from memory_service.tier.disk_tier import DiskTier, TierIdentity
    from memory_service.tier.tier import IoTier, MemoryTier
    from memory_service.tier.worker import TierWorker


class MemoryCore:
    """The block manager, its lock, its tiers and its KV-event log, behind one ``step``.

    Args:
        config: the block manager's configuration (pool size, prefix caching, the reserved pool).
        copy_block: copies one block's K and V to another, every layer (copy-on-write).
        kv_events: told of every block committed, evicted, stored in or dropped from a tier
            (manager/kv_events.py); None: no events.
    """

    def __init__(self, config: BlockManagerConfig, copy_block: Callable[[int, int], None], *,
                 kv_events: KvEventLog | None = None) -> None:
        self.block_manager = BlockManager(config, copy_block=copy_block)
        self.lock = threading.Lock()
        self.kv_events = kv_events
        if kv_events is not None:
            self.block_manager.send_kv_events(kv_events)
        self.tier: TierWorker | None = None  # once the tiers are open
        self.tier_identity: TierIdentity | None = None  # the tiers' model and layout, once open
        self._is_closed = False  # close_tiers ran: no tier may start any more

    @property
    def config(self) -> BlockManagerConfig:
        """The block manager's configuration (pool size, block size, the reserved pool)."""
        return self.block_manager.config

    # --- clients ----------------------------------------------------------------------------

    def add_client(self, client_id: str, max_blocks: int | None, tier_identity: bytes | None) -> None:
        """Adds a client (``BlockManager.add_client``): its quota of block-table entries (None: the
        pool) and the tier identity its committed blocks are kept under (None: not kept)."""
        with self.lock:
            self.block_manager.add_client(client_id, max_blocks, tier_identity)

    def release_client(self, client_id: str) -> int:
        """Frees every sequence of a client and forgets it; returns how many sequences it held."""
        with self.lock:
            return self.block_manager.release_client(client_id)

    def num_sequences_of(self, client_id: str) -> int:
        """The live sequences of a client."""
        with self.lock:
            return self.block_manager.num_sequences_of(client_id)

    # --- steps ------------------------------------------------------------------------------

    def step(self, client_id: str, ops: Sequence[Op], prefill_tokens_per_s: float = 0.0, *,
             on_new_loads: Callable[[list[TierLoad]], None] | None = None) -> StepResult:
        """Applies one client's batch of ops, in order, all validated before any applies.

        Args:
            client_id: an attached client.
            ops: the batch; one result per op, in order (``ok=False``: out of blocks or quota;
                ``loading``: retry once the sequence is in a later step's ``loaded_seq_ids``).
            prefill_tokens_per_s: the client's measured prefill speed (0: unknown), for the choice
                between loading a prefix from a tier and recomputing it.
            on_new_loads: told of the tier loads this step begins, before they are submitted (the
                servicer's traces: a loader that ends one at once finds its parent span).

        Returns:
            The results, and the blocks the client may still take: the pool's counts clipped by
            what its quota allows (its scheduler plans with these), and the sequences whose tier
            load ended.

        Raises:
            InvalidArgument: a bad batch or speed (a caller bug; nothing was applied).
        """
        if not (math.isfinite(prefill_tokens_per_s) and prefill_tokens_per_s >= 0):
            raise InvalidArgument(f"prefill_tokens_per_s must be a finite number >= 0, got {prefill_tokens_per_s}")
        manager = self.block_manager
        with self.lock:
            manager.set_prefill_speed(client_id, prefill_tokens_per_s)
            results = manager.apply(client_id, ops)
            num_available, num_available_reserved = manager.num_available_blocks()
            # Negative after forks past the quota (block_manager.py's docstring): then nothing is left.
            quota_left = max(0, manager.num_quota_left(client_id))
            loaded_seq_ids = manager.take_load_reports(client_id)
            new_loads = manager.take_new_loads()
        if on_new_loads is not None:
            on_new_loads(new_loads)
        if self.tier is not None:
            self.tier.submit(new_loads)  # and wakes the writer for the blocks this step committed
        # The general pool is taken first, so the quota clips the general count, then the reserved.
        num_available_reserved = min(num_available_reserved, quota_left - min(num_available, quota_left))
        num_available = min(num_available, quota_left)
        return StepResult(results, num_available, num_available_reserved, loaded_seq_ids)

    def commit(self, client_id: str) -> None:
        """The K/V of the client's last step is written: its full blocks may be shared."""
        with self.lock:
            self.block_manager.commit(client_id)
        if self.tier is not None:
            self.tier.submit([])  # wakes the writer for the blocks just committed

    def block_table(self, client_id: str, seq_id: str) -> list[int]:
        """The whole block table of one of a client's sequences."""
        with self.lock:
            return self.block_manager.block_table(client_id, seq_id)

    # --- tiers ------------------------------------------------------------------------------

    def open_tiers(self, identity: TierIdentity, pool: torch.Tensor, *, host_bytes: int | None = None,
                   disk: DiskTier | None = None, more: Sequence[MemoryTier | IoTier] = (),
                   on_load_done: Callable[[TierLoad, float, int, dict[str, int]], None] | None = None) -> None:
        """Opens the tiers below the pool for ``identity`` and starts their threads (seconds: a disk
        tier reads every file's header, a host tier allocates, and on CUDA page-locks, its buffer).

        Args:
            identity: the model and pool layout the tiers' blocks are keyed by.
            pool: the KV pool tensor, ``(num_layers, 2, num_blocks, block_size, num_kv_heads,
                head_dim)``, that the tiers' threads read and write.
            host_bytes: a host-RAM tier of this many bytes (page-locked when ``pool`` is on CUDA);
                None: none.
            disk: a disk tier, made but not yet opened; None: none.
            more: other tiers (tier/tier.py's Protocols), made but not yet opened: memory tiers go
                after the host tier, IO tiers after the disk tier, each in the order given.
            on_load_done: the tier worker's hook after each load (``TierWorker.on_load_done``).

        Raises:
            UnavailableError: ``close_tiers`` already ran (the service is stopping).
        """
        from memory_service.tier.host_tier import HostTier
        from memory_service.tier.tier import MemoryTier
        from memory_service.tier.worker import TierWorker

        assert self.tier is None, "the tiers are already open"
        host = HostTier(host_bytes) if host_bytes is not None else None
        memory = [t for t in (host, *more) if t is not None and isinstance(t, MemoryTier)]
        io = [t for t in (disk, *more) if t is not None and not isinstance(t, MemoryTier)]
        tiers = [*memory, *io]  # fastest first
        for t in sorted(tiers, key=lambda t: t is not disk):  # the disk first, as before the host
            t.open(identity, pin_memory=pool.is_cuda)
        found = [(t.medium, t.take_found()) for t in io]  # taken anyway: an IO tier keeps them until asked
        if self.kv_events is not None:
            self._send_tier_events(self.kv_events, tiers, identity.digest, found)
        with self.lock:
            # ``close_tiers`` reads ``tier`` under this lock after marking the core closed.
            if self._is_closed:
                raise UnavailableError("the memory service is shutting down")
            tier = TierWorker(self.block_manager, self.lock, pool, tiers)
            tier.on_load_done = on_load_done
            self.block_manager.enable_tier(tier)
            self.tier = tier
            self.tier_identity = identity

    def _send_tier_events(self, events: KvEventLog, tiers: Sequence[MemoryTier | IoTier], identity_digest: bytes,
                          found: list[tuple[str, list[tuple[bytes, bytes, BlockOrigin]]]]) -> None:
        """The tiers tell ``events`` what they store and drop, in their media, after what the IO tiers
        found from an earlier service (``IoTier.take_found``, parents first; manager/kv_events.py)."""
        events.set_tier_capacity(self.config.num_blocks + sum(tier.num_slots for tier in tiers))
        for medium, blocks in found:
            roots = {root_hash(identity_digest, ns_key) for _, ns_key, _ in blocks}  # a first block's parent
            events.tier_found(medium, [(key, ns_key, None if origin.parent_key in roots else origin.parent_key,
                                        origin.token_bytes) for key, ns_key, origin in blocks])
        for tier in tiers:
            tier.on_change = functools.partial(events.tier_changed, tier.medium)

    def close_tiers(self) -> None:
        """Stops the tiers' threads (they read and write the pool: call before freeing it); a later
        ``open_tiers`` refuses."""
        with self.lock:
            self._is_closed = True
            tier, self.tier = self.tier, None
        if tier is not None:
            tier.close()

    def load_latency(self) -> dict[str, tuple[list[tuple[float, int]], float]]:
        """The tiers' load latency histograms (``TierWorker.load_latency``), empty without a tier."""
        tier = self.tier
        return tier.load_latency() if tier is not None else {}

    # --- inspection -------------------------------------------------------------------------

    def stats(self) -> BlockManagerStats:
        """A snapshot of blocks, cache, clients and tiers; safe to call from any thread."""
        with self.lock:
            stats = self.block_manager.stats()
            if self.tier is not None:
                stats = dataclasses.replace(stats, tiers=self.tier.stats())
        return stats

    def check_integrity(self) -> str | None:
        """None when every invariant of the block manager holds, else the first broken one."""
        try:
            with self.lock:
                self.block_manager.check_integrity()
        except AssertionError as exc:  # a bug: reported to the caller, not hidden
            return str(exc) or "integrity check failed"
        return None
