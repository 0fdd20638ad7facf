"""The block manager's book of a tier below the pool: which blocks to write out, which loads run.

Pure bookkeeping under the manager's lock, like the rest of ``manager/``; the file IO happens in
``memory_service/tier/worker.py``'s threads, which take their work from here and report back.

Write-behind. A full block of a client that uses the tier gets a tier key (``chain.py``) when
it registers in the prefix cache, kept in ``PrefixCache.tier_hashes`` (cleared when the block loses
its cache key). When the client commits it (its K/V is written), the block joins ``to_persist``;
the writer thread takes it from there, checks under the lock that the block still holds that key
(it was not evicted and reused meanwhile), copies its bytes and writes them out. Eviction inside a
Step never waits for any of it: a block evicted before its turn is simply not written. Only clients
with a tier identity get keys, and only trusted clients get one (the servicer decides), so a block
that a foreign client committed is never persisted.

Loads. An AllocateOp whose pool prefix stops short while the tier holds the blocks that follow
starts a load, if ``TierDirectory.worth_loading`` says it beats recomputing: the pool prefix is
pinned (a reference held by the load, so its cache entries stay valid as the loaded blocks' parent),
fresh blocks are taken for the tier's blocks, and the op answers ``loading`` having allocated
nothing. The loader thread fills the fresh blocks (nobody else can see them: no table holds them,
no key names them), then ``BlockManager.finish_load`` registers them as committed cache entries and
drops the pins: they sit at the young end of the LRU, and the client's retried AllocateOp finds them
in the pool. One load per sequence: the retry never starts another (a load that failed, or blocks
evicted before the retry, mean recompute, never a loop).

Parked sequences the client drops. The book remembers a sequence from its load's start until its
AllocateOp gets blocks (``allocated``): while the load runs, then as ``loaded`` (no second load).
A client that drops such a sequence instead (a request aborted while parked, or after its load
ended but before its retry got blocks) sends a FreeOp for it (memory.proto's ``OpResult.loading``),
which ``forget`` handles: the sequence leaves ``loaded`` and ``reports``, and a load still running
ends unreported. Without it each such sequence would stay in the book until its client detaches.

Quotas. The blocks a load pins (its pool prefix and its fresh blocks) are the client's while it runs,
so they count against the client's quota of block-table entries (``BlockManager``'s module docstring)
until it ends, as the retried AllocateOp's table will: a load takes no more tier blocks than leave
room, within the quota, for that retry's table (the prefix, the loaded blocks and the blocks of its
first new tokens). The fresh blocks come from the pools the AllocateOp may take (the reserved pool
only for a priority that ``ReservedPool`` admits).

Counters. A sequence's AllocateOp is sent again until it gets its blocks (a pool too full, a quota
spent, a load running or over), and each try looks the tier up again; the lookup is counted once per
allocation: when its load starts (the retry then finds the blocks in the pool), else when it gets
its blocks. The book decides when; the tiers' worker counts what (``TierDirectory.count_lookup``:
hits, misses and skipped loads per tier, ``tier/accounts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from memory_service.manager.block_pool import BlockPool


class TierDirectory(Protocol):
    """What the manager asks a tier while it applies an op (both answers are in-memory, no IO)."""

    def num_leading(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the tier holds."""
        ...

    def count_lookup(self, keys: list[bytes], num_found: int, is_skipped: bool) -> None:
        """Counts, per tier (a host tier in front of a disk tier: ``tier/accounts.py``), a lookup of
        ``keys`` whose first ``num_found`` the tiers held, and whose load was skipped if so."""
        ...

    def worth_loading(self, keys: list[bytes], prefill_tokens_per_s: float) -> bool:
        """Whether loading the blocks ``keys`` (each in some tier) is expected to beat recomputing
        their tokens (each tier read at its own measured speed)."""
        ...

    def needs_write(self, key: bytes) -> bool:
        """Whether the tier that outlives the service lacks the block ``key`` (one loaded from RAM)."""
        ...


@dataclass(frozen=True, slots=True)
class TierLookup:
    """What an allocation found in the tier after its pool prefix (module docstring, "Counters").

    Args:
        is_loading: the allocation waits for a load (started by this lookup, or still running).
        num_hits: blocks the tier holds right after the pool's prefix (within the cacheable ones).
        is_skipped: the tier's blocks are recomputed: loading them was estimated slower.
        num_pinned: blocks that the load this lookup started pins (0 when it started none).
        keys: the tier keys looked up (past the pool's prefix), for the per-tier counts.
    """

    is_loading: bool = False
    num_hits: int = 0
    is_skipped: bool = False
    num_pinned: int = 0
    keys: list[bytes] = field(default_factory=list)


WAITING = TierLookup(is_loading=True)  # a load of this allocation is running (counted when it started)
COUNTED = TierLookup()  # its load is over: counted when it started


@dataclass(slots=True)
class TierLoad:
    """One allocation's blocks on their way from the tier into the pool.

    Args:
        client_id, seq_id: the allocation that waits for them.
        ns_key: its namespace key.
        hashes: the tier keys of the blocks to load, in prompt order.
        token_bytes: the encoded tokens of those blocks (to register them in the prefix cache).
        prefix_block_ids: the pool's cached prefix before them, pinned by the load.
        block_ids: fresh pool blocks, one per key, pinned by the load.
        is_wanted: False once the client freed the sequence (``TierBook.forget``): the load ends
            unreported, unless an AllocateOp of the same seq_id waits for it again.
    """

    client_id: str
    seq_id: str
    ns_key: bytes
    hashes: list[bytes]
    token_bytes: bytes
    prefix_block_ids: list[int]
    block_ids: list[int]
    is_wanted: bool = True


class TierBook:
    """Write-behind queue, loads in flight and their reports (module docstring).

    Args:
        directory: the tier's in-memory index and cost estimate.
    """

    def __init__(self, directory: TierDirectory) -> None:
        self.directory = directory
        self.identities: dict[str, bytes] = {}  # client_id -> its TierIdentity.digest (tier users only)
        self.prefill_speeds: dict[str, float] = {}  # client_id -> prompt tokens/s it last reported
        # committed block -> (its tier key, its generation at the commit: BlockPool.generations), oldest first
        self.to_persist: dict[int, tuple[bytes, int]] = {}
        self.num_missed = 0  # committed blocks evicted before the writer took them (not kept)
        self.loads: dict[tuple[str, str], TierLoad] = {}  # in flight, by (client_id, seq_id)
        self.new_loads: list[TierLoad] = []  # started, not yet handed to the loader
        self.loaded: dict[str, set[str]] = {}  # client_id -> seq_ids whose load ended (no second one)
        self.reports: dict[str, list[str]] = {}  # client_id -> seq_ids to report in its next Step
        self.num_pinned: dict[str, int] = {}  # client_id -> blocks its loads in flight pin (its quota's)

    def add_client(self, client_id: str, identity_digest: bytes | None) -> None:
        if identity_digest is not None:
            self.identities[client_id] = identity_digest
        self.loaded[client_id] = set()
        self.reports[client_id] = []

    def release_client(self, client_id: str) -> None:
        """Forgets a client; its loads in flight still end (``finish_load``), unreported."""
        for table in (self.identities, self.prefill_speeds, self.loaded, self.reports, self.num_pinned):
            table.pop(client_id, None)

    def pinned_block_ids(self) -> list[int]:
        """Every block a load in flight holds a reference to (for the integrity check)."""
        return [b for load in self.loads.values() for b in (*load.prefix_block_ids, *load.block_ids)]

    def start_load(self, client_id: str, seq_id: str, hashes: list[bytes], prefix_block_ids: list[int],
                   max_num_blocks: int, max_num_load_blocks: int, prompt_bytes: bytes, block_width: int,
                   ns_key: bytes, may_use_reserved: bool, pool: BlockPool) -> TierLookup:
        """Looks up the tier for an allocation whose pool prefix (``prefix_block_ids``) is short of
        ``max_num_blocks``, and starts a load when the tier holds what follows and loading is worth it.

        Args:
            hashes: tier keys of the prompt's full blocks (at least ``max_num_blocks``).
            max_num_load_blocks: the most blocks the load may take (what the client's quota leaves
                for them; the module docstring, "Quotas").
            prompt_bytes: the encoded prompt; block_width: bytes per block of it.
            may_use_reserved: the allocation's priority may take the reserved pool's blocks.

        Returns:
            The lookup: ``is_loading`` when the allocation must wait for a load (started now, or
            still running; counted when it started); otherwise what it found, for ``allocated`` to
            count once the allocation gets its blocks.
        """
        key = (client_id, seq_id)
        running = self.loads.get(key)
        if running is not None:
            running.is_wanted = True  # (the seq_id allocated again after a FreeOp: it waits for it too)
            return WAITING  # retried before its load ended: keep waiting
        if seq_id in self.loaded[client_id]:
            return COUNTED  # its one load is over: what is not in the pool now is recomputed
        num_pool = len(prefix_block_ids)
        keys = hashes[num_pool:max_num_blocks]
        num_tier = self.directory.num_leading(keys)
        if not num_tier:
            return TierLookup(False, 0, keys=keys)
        if not self.directory.worth_loading(keys[:num_tier], self.prefill_speeds.get(client_id, 0.0)):
            return TierLookup(False, num_tier, is_skipped=True, keys=keys)
        # No more than the quota and the pool leave room for: recompute the rest as they allow.
        num_load = min(num_tier, max_num_load_blocks, pool.num_available(may_use_reserved, sharing=prefix_block_ids))
        if num_load <= 0:
            return TierLookup(False, num_tier, keys=keys)
        pool.share(prefix_block_ids)
        block_ids = pool.take(num_load, may_use_reserved)
        end = num_pool + num_load
        load = TierLoad(client_id, seq_id, ns_key, hashes[num_pool:end],
                        prompt_bytes[num_pool * block_width : end * block_width], list(prefix_block_ids), block_ids)
        self.loads[key] = load
        self.new_loads.append(load)
        self.num_pinned[client_id] = self.num_pinned.get(client_id, 0) + end
        lookup = TierLookup(True, num_tier, num_pinned=end, keys=keys)
        self._count(lookup)
        return lookup

    def allocated(self, client_id: str, seq_id: str, lookup: TierLookup | None) -> None:
        """The allocation got its blocks: its lookup is counted (unless its load counted it), and a
        later allocation of the same sequence id may load again.

        Args:
            lookup: what ``start_load`` answered it this time; None when its pool prefix was whole
                (no tier lookup).
        """
        self.loaded[client_id].discard(seq_id)
        if lookup is not None:
            self._count(lookup)

    def is_parked(self, client_id: str, seq_id: str) -> bool:
        """Whether the client's AllocateOp of ``seq_id`` was answered ``loading`` and has not got
        its blocks since (its load runs, or ended): a FreeOp of it is valid (``forget``)."""
        load = self.loads.get((client_id, seq_id))
        return (load is not None and load.is_wanted) or seq_id in self.loaded.get(client_id, ())

    def forget(self, client_id: str, seq_id: str) -> None:
        """The client freed a parked sequence (the module docstring, "Parked sequences the client
        drops"): the book keeps nothing of it, and a load still running ends unreported."""
        load = self.loads.get((client_id, seq_id))
        if load is not None:
            load.is_wanted = False
        loaded = self.loaded.get(client_id)
        if loaded is not None and seq_id in loaded:
            loaded.discard(seq_id)
            reports = self.reports[client_id]
            if seq_id in reports:  # ended since the client's last Step: nothing to report now
                reports.remove(seq_id)

    def _count(self, lookup: TierLookup) -> None:
        if lookup.keys:
            self.directory.count_lookup(lookup.keys, lookup.num_hits, lookup.is_skipped)

    def end_load(self, load: TierLoad) -> None:
        """The load is over (``finish_load`` registered what it could): report it to its client,
        unless the client freed the sequence meanwhile."""
        del self.loads[(load.client_id, load.seq_id)]
        if load.client_id in self.num_pinned:  # still attached
            self.num_pinned[load.client_id] -= len(load.prefix_block_ids) + len(load.block_ids)
        if load.is_wanted and load.client_id in self.reports:  # still attached, still waited for
            self.loaded[load.client_id].add(load.seq_id)
            self.reports[load.client_id].append(load.seq_id)

    def take_reports(self, client_id: str) -> list[str]:
        """The client's sequences whose load ended since it last asked (each reported once)."""
        reports = self.reports.get(client_id)
        if not reports:
            return []
        self.reports[client_id] = []
        return reports

    def take_new_loads(self) -> list[TierLoad]:
        new_loads, self.new_loads = self.new_loads, []
        return new_loads
