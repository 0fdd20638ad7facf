"""KV events: which blocks the memory service holds, and where, as vLLM's KV events say it.

Routers that place requests by prefix (llm-d's precise prefix-cache scorer, Dynamo's KV router)
keep an index of the blocks each engine holds, fed by the engine's events: ``BlockStored`` (blocks
that can now be shared), ``BlockRemoved`` (blocks gone), ``AllBlocksCleared`` (start over). Here
the memory service is the one that knows (it owns the pool and the tiers below it), so it sends them
(memory_service/service/kv_events.py puts them on the wire); this module says what happened, under
the manager's lock or a tier's, and never waits: the changes queue here, bounded, and become events
on the publisher's thread (``KvEventLog`` says why).

When each event is made:
- ``BlockStored`` medium ``MEDIUM_POOL``: a block's K/V is committed (``PrefixCache.commit``): other
  clients may share it from now on. Pending blocks are never announced (their bytes may never be
  written); a block loaded from a tier is announced when its load registers it.
- ``BlockRemoved`` medium ``MEDIUM_POOL``: the pool evicts a cached block (``PrefixCache.evict``).
- ``BlockStored``/``BlockRemoved`` medium ``MEDIUM_HOST``/``MEDIUM_DISK``: a tier took a copy of a
  block announced in the pool before (the tiers are inclusive: a block may be in several media at
  once, one event each), or dropped one.
- ``AllBlocksCleared``: the service (re)started, or changes were dropped (``KvEventLog`` says why):
  every earlier event of this endpoint is void.
- ``BlockStored`` medium ``MEDIUM_DISK`` at a start, after that ``AllBlocksCleared``: the blocks the
  disk tier found from an earlier service (its files keep each block's parent and tokens:
  tier/disk_tier.py), once the tiers open, parents first, each chain in a row (one event per chain,
  ``MAX_FOUND_RUN_BLOCKS`` blocks at most). Their namespaces have not been named yet in this
  process, so they count as salted (below) until a request names them: a router then misses those
  unsalted prompts' disk blocks (their keys differ), never mixes tenants.

Block hashes: each block gets a 64-bit hash chained over (its parent's hash, its namespace key, its
token ids), so equal content in one namespace has one hash in every medium and across restarts, as
vLLM's hashes do; ``parent_block_hash`` is the previous block's (None for a sequence's first).
Consumers that recompute their own keys from ``token_ids`` use the hashes only to apply removals.

A cache salt travels in ``extra_keys``, vLLM's place for it: one entry per block,
``[namespace key as hex]`` = ``namespace_key(cache_namespace(model, cache_salt)).hex()``
(memory_service.api), the same for every block of one model and salt, different across tenants, so a
router that reads it keeps tenants apart; a digest, never the salt itself (the service only ever sees the
namespace, and a gateway's salts derive from API keys). Blocks of a request without a salt carry none
(``extra_keys`` nil, as vLLM sends them), so a router's keys of unsalted prompts match ours; a
namespace the log has not seen named in an AllocateOp (``note_namespaces``) counts as salted.

Medium names are those routers already know: ``GPU`` for the engine's own KV pool (vLLM's one name
for the engine's cache, whatever its device), ``CPU`` for the host-RAM tier (vLLM's offload
medium), ``DISK`` for the disk tier (SGLang's).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from memory_service.manager.prefix_cache import ROOT_ENTRY_ID, namespace_key
from memory_service.token_encoding import decode_token_ids

MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
# Changes (a block stored or removed, a clear, a namespace named) waiting for the publisher beyond
# which the backlog is dropped (and counted): a subscriber, or a publisher, that falls behind never
# holds a Step or a tier's writer, and the backlog's memory stays bounded.
MAX_PENDING_CHANGES = 100_000
MAX_NAMESPACES = 4096  # namespaces whose salt (or none) the log remembers
# Blocks found at a start per record (a large disk index is several), and per event (one chain).
FOUND_RECORD_BLOCKS = 10_000
MAX_FOUND_RUN_BLOCKS = 256
# ``cache_namespace(model, "")`` ends so: a namespace without a cache salt.
UNSALTED_SUFFIX = "|"


@dataclass(frozen=True)
class BlockStored:
    """Blocks of one chain (each the parent of the next) now held in ``medium``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # block_size per block, in order
    block_size: int
    medium: str
    namespace: str | None  # the namespace key, hex; None without a cache salt (the module docstring)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class _Block:
    """What a ``BlockStored`` says of one block, kept for the tiers' copies of it."""

    block_hash: int
    parent_hash: int | None
    token_bytes: bytes
    namespace: str | None


class KvEventLog:
    """What happened since the publisher last asked, bounded; thread-safe.

    Why two halves: the block manager's lock (every client's Step waits on it) and a tier's are
    held only for a list append per change (a raw record: entry ids, the cache key's bytes, a tier
    key); hashing, decoding tokens and building events happen in ``take``, on the publisher's
    thread, which alone keeps the resolver's state (the hashes of cached entries, the tiers' blocks).
    Records resolve in the order they were made, so a parent is always known before its child.

    Why a drop voids everything: a dropped store leaves its children without a parent hash (announced
    as first blocks they would index false prefixes), a dropped removal leaves consumers (and
    ``_pool``) with a block that is gone. So a change past the bound drops the whole backlog; the
    next ``take`` sends ``AllBlocksCleared`` and forgets what it knew of the pool and the tiers. It
    does not announce the current holdings again: the log knows them only through the records it
    dropped, and asking the block manager would take its lock from the publisher's thread. From then
    on a block is announced only if its parent is known (a root, or a block announced since the
    clear); one whose parent is unknown is skipped (counted as dropped), and so are its children.
    Blocks cached before the drop go unannounced until evicted and stored again: routers miss them
    (a lost hit), never index a prefix that is not there.

    Args:
        block_size: tokens per block.
        max_pending_records: changes kept for the publisher (a record of n blocks or namespaces
            counts n); one more drops them all (above).
    """

    def __init__(self, block_size: int, max_pending_records: int = MAX_PENDING_CHANGES) -> None:
        self.block_size = block_size
        self.max_pending_records = max_pending_records
        self.num_events = 0  # made (resolved), by ``take``
        self.num_dropped_events = 0  # changes dropped before they became events, or blocks not announced
        self._lock = threading.Lock()
        self._has_records = threading.Condition(self._lock)
        self._records: list[tuple] = []  # (kind, payload) in order; kinds: the _on_* methods below
        self._num_pending = 0  # changes in _records (a record of n blocks counts n)
        # The resolver's state, touched by ``take`` only:
        self._pool: dict[int, _Block] = {}  # prefix-cache entry id -> its block, while the pool caches it
        # Tier key -> its block, for the tiers' copies of blocks the pool announced; least recently
        # stored first, at most ``_max_tier_blocks`` (set when the tiers open: what they and the pool hold).
        self._tier_blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._max_tier_blocks = 0  # set under the lock by ``set_tier_capacity``, read by ``take``
        self._is_salted: dict[bytes, bool] = {}  # namespace key -> whether its namespace has a cache salt
        self._num_unannounced = 0  # blocks this ``take`` skipped: their parent is unknown

    # --- told under the block manager's lock --------------------------------------------------

    def note_namespaces(self, namespaces: Iterable[str]) -> None:
        """The namespaces of a batch's AllocateOps: which of them carry a cache salt."""
        names = list(namespaces)
        if names:
            self._record("namespaces", names, len(names))

    def pool_stored(self, blocks: list[tuple[int, tuple[int, bytes, bytes], bytes | None]]) -> None:
        """Blocks committed in the pool, parents first.

        Args:
            blocks: per block, its prefix-cache entry id, its cache key (parent entry id, token bytes,
                namespace key) and its tier key (None without a tier); kept as they are (immutable).
        """
        if blocks:
            self._record("pool_stored", blocks, len(blocks))

    def pool_removed(self, entry_ids: list[int]) -> None:
        """Blocks the pool evicted."""
        if entry_ids:
            self._record("pool_removed", entry_ids, len(entry_ids))

    # --- told by the tiers' threads -----------------------------------------------------------

    def set_tier_capacity(self, num_blocks: int) -> None:
        """The tiers are open: their blocks and the pool's together (bounds what is kept for them).

        A value, not a record: it is never dropped with a backlog, and takes no room in it.
        """
        with self._lock:
            self._max_tier_blocks = num_blocks

    def tier_found(self, medium: str, blocks: list[tuple[bytes, bytes, bytes | None, bytes]]) -> None:
        """Blocks a tier held before this start (the disk tier's files), parents first.

        Args:
            blocks: per block, its tier key, its namespace key, its parent's tier key (None for a
                namespace's first block) and its token bytes.
        """
        for start in range(0, len(blocks), FOUND_RECORD_BLOCKS):
            chunk = blocks[start:start + FOUND_RECORD_BLOCKS]
            self._record("tier_found", (medium, chunk), len(chunk))

    def tier_changed(self, medium: str, tier_key: bytes, is_stored: bool) -> None:
        """A tier stored or dropped the block ``tier_key``."""
        self._record("tier_changed", (medium, tier_key, is_stored), 1)

    def cleared(self) -> None:
        """The service (re)started: consumers forget this endpoint's blocks."""
        self._record("cleared", None, 1)

    # --- the publisher's thread ---------------------------------------------------------------

    def take(self, timeout_s: float) -> list[KvEvent]:
        """The events since the last call, oldest first; waits up to ``timeout_s`` for a change."""
        with self._has_records:
            if not self._records:
                self._has_records.wait(timeout_s)
            records, self._records, self._num_pending = self._records, [], 0
            max_tier_blocks = self._max_tier_blocks
        events: list[KvEvent] = []
        self._num_unannounced = 0
        for kind, payload in records:
            getattr(self, f"_on_{kind}")(payload, events, max_tier_blocks)
        self.num_events += len(events)
        with self._lock:
            self.num_dropped_events += self._num_unannounced
        return events

    def _on_namespaces(self, namespaces: list[str], events: list[KvEvent], _: int) -> None:
        for namespace in namespaces:
            ns_key = namespace_key(namespace)
            if ns_key not in self._is_salted:
                if len(self._is_salted) >= MAX_NAMESPACES:
                    self._is_salted.clear()  # forgotten ones count as salted until named again
                self._is_salted[ns_key] = not namespace.endswith(UNSALTED_SUFFIX)

    def _on_pool_stored(self, blocks: list, events: list[KvEvent], max_tier_blocks: int) -> None:
        run: list[_Block] = []
        for entry_id, (parent_entry_id, token_bytes, ns_key), tier_key in blocks:
            parent = self._pool.get(parent_entry_id)
            if parent is None and parent_entry_id != ROOT_ENTRY_ID:
                self._num_unannounced += 1  # its parent's store was dropped (the class docstring)
                continue
            block = self._block(parent, ns_key, token_bytes)
            self._pool[entry_id] = block
            if tier_key is not None:
                self._keep_tier_block(tier_key, block, max_tier_blocks)
            run = self._extend_run(run, block, events, MEDIUM_POOL)
        if run:
            events.append(self._stored(run, MEDIUM_POOL))

    def _on_tier_found(self, found: tuple[str, list], events: list[KvEvent], max_tier_blocks: int) -> None:
        medium, blocks = found
        run: list[_Block] = []
        for tier_key, ns_key, parent_key, token_bytes in blocks:
            parent = self._tier_blocks.get(parent_key) if parent_key is not None else None
            if parent is None and parent_key is not None:
                self._num_unannounced += 1  # its parent's record was dropped (the class docstring)
                continue
            block = self._block(parent, ns_key, token_bytes)
            self._keep_tier_block(tier_key, block, max_tier_blocks)
            run = self._extend_run(run, block, events, medium, MAX_FOUND_RUN_BLOCKS)
        if run:
            events.append(self._stored(run, medium))

    def _on_pool_removed(self, entry_ids: list[int], events: list[KvEvent], _: int) -> None:
        hashes = [self._pool.pop(entry_id).block_hash for entry_id in entry_ids if entry_id in self._pool]
        if hashes:
            events.append(BlockRemoved(hashes, MEDIUM_POOL))

    def _on_tier_changed(self, change: tuple[str, bytes, bool], events: list[KvEvent], _: int) -> None:
        # A block neither the pool nor a tier's files announced in this process (one whose file held
        # no origin, or whose parent's file was gone) has no tokens here: no event.
        medium, tier_key, is_stored = change
        block = self._tier_blocks.get(tier_key)
        if block is None:
            return
        if is_stored:
            self._tier_blocks.move_to_end(tier_key)
            events.append(self._stored([block], medium))
        else:
            events.append(BlockRemoved([block.block_hash], medium))

    def _on_cleared(self, _: None, events: list[KvEvent], __: int) -> None:
        events.append(AllBlocksCleared())

    def _on_lost(self, _: None, events: list[KvEvent], __: int) -> None:
        # A backlog was dropped (the class docstring): consumers and this resolver start over.
        events.append(AllBlocksCleared())
        self._pool.clear()
        self._tier_blocks.clear()

    # --- inside -------------------------------------------------------------------------------

    def _block(self, parent: _Block | None, ns_key: bytes, token_bytes: bytes) -> _Block:
        """A block's event identity: its hash chained over its parent's (the module docstring)."""
        parent_hash = parent.block_hash if parent is not None else None
        digest = hashlib.blake2b((parent_hash or 0).to_bytes(8, "big") + ns_key + token_bytes, digest_size=8)
        namespace = ns_key.hex() if self._is_salted.get(ns_key, True) else None
        return _Block(int.from_bytes(digest.digest(), "big"), parent_hash, token_bytes, namespace)

    def _keep_tier_block(self, tier_key: bytes, block: _Block, max_tier_blocks: int) -> None:
        """Remembers ``block`` for the tiers' events of ``tier_key``, least recently stored first, bounded."""
        if max_tier_blocks:
            self._tier_blocks[tier_key] = block
            self._tier_blocks.move_to_end(tier_key)
            while len(self._tier_blocks) > max_tier_blocks:
                self._tier_blocks.popitem(last=False)

    def _extend_run(self, run: list[_Block], block: _Block, events: list[KvEvent], medium: str,
                    max_run_blocks: int | None = None) -> list[_Block]:
        """``run`` (blocks of one chain and namespace) with ``block``; a block that does not continue
        it (or a full run) sends it as one event first."""
        if run and (block.parent_hash != run[-1].block_hash or block.namespace != run[0].namespace
                    or (max_run_blocks is not None and len(run) >= max_run_blocks)):
            events.append(self._stored(run, medium))
            run = []
        run.append(block)
        return run

    def _stored(self, blocks: list[_Block], medium: str) -> BlockStored:
        return BlockStored([b.block_hash for b in blocks], blocks[0].parent_hash,
                           decode_token_ids(b"".join(b.token_bytes for b in blocks)), self.block_size, medium,
                           blocks[0].namespace)

    def _record(self, kind: str, payload: object, num_changes: int) -> None:
        with self._has_records:
            if self._num_pending + num_changes > self.max_pending_records:
                # The whole backlog goes, replaced by one marker (the class docstring says why).
                self.num_dropped_events += self._num_pending + num_changes
                self._records, self._num_pending = [("lost", None)], 0
            else:
                self._records.append((kind, payload))
                self._num_pending += num_changes
            self._has_records.notify()
