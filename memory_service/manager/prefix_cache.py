"""Prefix cache: a content-addressed index of full KV blocks, so equal prompt prefixes share blocks.

A full block's content is its key ``(parent_entry_id, token_bytes, namespace_key)``:

- ``token_bytes``: the block's own ``block_size`` token ids, encoded by
  ``token_encoding.encode_token_ids`` (``TOKEN_WIDTH`` = 4 bytes each). Bytes rather than a tuple of
  ints: a bytes object hashes and compares as one buffer and caches its hash, and freeing it touches
  no int objects;
- ``parent_entry_id``: the cache entry of the block before it in the sequence (``ROOT_ENTRY_ID``
  for a first block). Each registration gets a new entry id, never reused;
- ``namespace_key``: a 16-byte digest of the namespace (model name + cache_salt), so tenants never
  share, and a client's long namespace costs the cache 16 bytes per block, not its length.

The hash of the key is the chained hash of (parent, token ids, namespace) of docs/design.md. The
index is a dict keyed by the whole key, and a dict compares keys on lookup: the token ids are stored
with the block and a hash collision can never share wrong content. Not in the block's prefix either:
the parent is named by its entry id, which stands for exactly one registration and, by induction
from the root, exactly one prefix (a parent named by its hash would let two prefixes whose hashes
collide adopt each other's children). The price: when a parent is evicted, its cached children can
no longer be reached; they are harmless and leave in LRU order like any other evictable block.

Why Python's own hash and not a digest per block (BLAKE2b, SHA-256): the dict hashes the key (the
token bytes with SipHash-1-3, keyed at random per process unless PYTHONHASHSEED is set, so
collisions cannot be aimed at from outside) and then compares the whole key, so a collision costs
one extra comparison, never a wrong share; a digest would cost several times the slice and its
hash per block and would still need the full comparison to be safe.

Commit before share. A block is registered when it fills, but its K/V is written afterwards, by the
client's forward pass. Until the client acknowledges that write, the entry is *pending*: owned by
that client, found by that client's own lookups (its engine orders its own writes and reads), and
invisible to every other client. ``commit`` publishes a client's pending entries; ``unregister``
drops those whose writer went away before committing, so unwritten bytes are never shared.

The cache only indexes blocks. Reference counts, the LRU of evictable blocks and the free lists live
in ``block_pool.BlockPool``, which has ``evict`` take blocks off an LRU when it needs them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

from typing import TYPE_CHECKING

from memory_service.manager.eviction_queue import EvictionQueue
from memory_service.token_encoding import TOKEN_WIDTH

if TYPE_CHECKING:
    from memory_service.manager.kv_events import KvEventLog

# Parent entry id of a sequence's first block.
ROOT_ENTRY_ID = 0

CacheKey = tuple[int, bytes, bytes]  # (parent_entry_id, token_bytes of the block, namespace_key)

NAMESPACE_KEY_SIZE = 16  # bytes of the namespace digest in each key


# Memoized: every AllocateOp asks for its namespace's key, and a service sees few namespaces (one
# per model and cache_salt); a BLAKE2b digest costs ~1 us, a cache hit ~0.1 us. 1024 entries of
# at most MAX_NAMESPACE_LENGTH characters bound its memory.
@functools.lru_cache(maxsize=1024)
def namespace_key(namespace: str) -> bytes:
    """Digest of a namespace for cache keys: fixed size whatever the namespace's length.

    Args:
        namespace: model name + cache_salt (any string).

    Returns:
        ``NAMESPACE_KEY_SIZE`` bytes; equal namespaces give equal keys, others differ (BLAKE2b).
    """
    return hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=NAMESPACE_KEY_SIZE).digest()


class PrefixCache:
    """Maps the content of full blocks to the block ids that hold it.

    Invariants (``check_integrity``): a block has a key iff the index maps that key to it; the entry
    ids of blocks with a key are unique; a parent entry id is smaller than its child's (the parent
    registered first); only a block with a key may be pending. A block without a key has a stale
    entry id, never read.

    Args:
        num_blocks: number of block ids, ``[0, num_blocks)``.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._block_ids: dict[CacheKey, int] = {}
        # Per block id; plain lists keep the hot path free of per-block objects.
        self.block_keys: list[CacheKey | None] = [None] * num_blocks
        self.entry_ids: list[int] = [ROOT_ENTRY_ID] * num_blocks  # meaningful while the block has a key
        # The client whose write of the block is not acknowledged yet; None once committed.
        self.pending_owners: list[str | None] = [None] * num_blocks
        # The block's key in a tier below the pool (chain.py), set by the tier's book for
        # clients that use one; cleared with the cache key, so it never outlives the content.
        self.tier_hashes: list[bytes | None] = [None] * num_blocks
        # The tier key of the block before it (chain.py's BlockOrigin), meaningful while its tier key is set.
        self.tier_parents: list[bytes] = [b""] * num_blocks
        self._next_entry_id = ROOT_ENTRY_ID + 1
        # Told of every block committed and evicted, when the service sends KV events (kv_events.py).
        self.events: KvEventLog | None = None

    def __len__(self) -> int:
        return len(self._block_ids)

    def match(self, token_bytes: bytes, ns_key: bytes, max_num_blocks: int, client_id: str) -> tuple[list[int], int]:
        """Finds the longest cached prefix of a prompt, block by block. Changes nothing.

        Args:
            token_bytes: the prompt, encoded.
            ns_key: the prompt's ``namespace_key``.
            max_num_blocks: look at most this many leading full blocks.
            client_id: who asks; another client's pending blocks end the match.

        Returns:
            The cached block ids of the prefix, in order, and the entry id of the last one
            (``ROOT_ENTRY_ID`` when nothing matched): the parent of the blocks that follow.
        """
        block_width = self.block_size * TOKEN_WIDTH
        get = self._block_ids.get
        entry_ids, owners = self.entry_ids, self.pending_owners
        block_ids: list[int] = []
        parent_entry_id = ROOT_ENTRY_ID
        for start in range(0, max_num_blocks * block_width, block_width):
            block_id = get((parent_entry_id, token_bytes[start : start + block_width], ns_key))
            if block_id is None:
                break
            owner = owners[block_id]
            if owner is not None and owner != client_id:
                break  # written (maybe) by another client that has not committed it: not shareable yet
            block_ids.append(block_id)
            parent_entry_id = entry_ids[block_id]
        return block_ids, parent_entry_id

    def register(
        self,
        block_ids: Sequence[int],
        token_bytes: bytes,
        start: int,
        ns_key: bytes,
        parent_entry_id: int,
        owner: str,
        pending: dict[int, None],
    ) -> int:
        """Registers blocks of one sequence that just became full, pending until ``owner`` commits.

        When an identical block is already cached (two sequences generated the same tokens), the
        sequence keeps its own block and it is not registered: no de-duplication, so block tables
        stay append-only. The chain goes on from the cached twin, so later blocks still register.

        Args:
            block_ids: consecutive blocks of one sequence, now full, not cached.
            token_bytes: encoded tokens of the sequence (or of a tail of it) holding their contents.
            start: the token index in ``token_bytes`` where ``block_ids[0]`` begins; the blocks follow.
            ns_key: the sequence's ``namespace_key``.
            parent_entry_id: entry id of the content of the block before ``block_ids[0]``.
            owner: the client that writes the blocks' K/V.
            pending: the owner's pending blocks (an ordered set); the newly registered ones join it.

        Returns:
            The entry id of the last block's content: the parent of the sequence's next block.
        """
        block_width = self.block_size * TOKEN_WIDTH
        start *= TOKEN_WIDTH
        setdefault = self._block_ids.setdefault
        block_keys, entry_ids, owners = self.block_keys, self.entry_ids, self.pending_owners
        next_entry_id = self._next_entry_id
        for block_id in block_ids:
            key = (parent_entry_id, token_bytes[start : start + block_width], ns_key)
            start += block_width
            cached_block_id = setdefault(key, block_id)
            if cached_block_id == block_id:
                block_keys[block_id] = key
                owners[block_id] = owner
                pending[block_id] = None
                parent_entry_id = entry_ids[block_id] = next_entry_id
                next_entry_id += 1
            else:
                parent_entry_id = entry_ids[cached_block_id]
        self._next_entry_id = next_entry_id
        return parent_entry_id

    def commit(self, block_ids: Iterable[int]) -> None:
        """Publishes pending blocks: their K/V is written, every client of the namespace may share them.

        Args:
            block_ids: pending blocks of one client.
        """
        owners = self.pending_owners
        for block_id in block_ids:
            owners[block_id] = None
        if self.events is not None:
            keys, entry_ids, tier_hashes = self.block_keys, self.entry_ids, self.tier_hashes
            self.events.pool_stored([(entry_ids[b], keys[b], tier_hashes[b]) for b in block_ids])

    def unregister(self, block_id: int) -> None:
        """Forgets a pending block whose writer went away before committing (its bytes are not valid).

        Args:
            block_id: a pending block; it keeps its references and becomes an uncached block.
        """
        del self._block_ids[self.block_keys[block_id]]
        self.block_keys[block_id] = None
        self.pending_owners[block_id] = None
        self.tier_hashes[block_id] = None

    def evict(self, lru: EvictionQueue, num_blocks: int) -> list[int]:
        """Takes the least recently used blocks off an LRU and forgets them, for reuse.

        Args:
            lru: cached, unreferenced (so committed) blocks, least recently used first (``BlockPool``'s).
            num_blocks: how many to evict (at most ``len(lru)``).

        Returns:
            The evicted block ids, least recently used first.
        """
        index, block_keys, tier_hashes = self._block_ids, self.block_keys, self.tier_hashes
        evicted = lru.pop_oldest(num_blocks)
        if self.events is not None:
            self.events.pool_removed([self.entry_ids[b] for b in evicted])
        for block_id in evicted:
            del index[block_keys[block_id]]
            block_keys[block_id] = None  # its entry id goes stale: read only while a key is set
            tier_hashes[block_id] = None
        return evicted

    def check_integrity(self) -> None:
        """Raises AssertionError if the index and the per-block keys, entry ids and owners disagree."""
        num_cached = 0
        seen_entry_ids: set[int] = set()
        block_width = self.block_size * TOKEN_WIDTH
        for block_id, key in enumerate(self.block_keys):
            if key is None:
                if self.pending_owners[block_id] is not None or self.tier_hashes[block_id] is not None:
                    raise AssertionError(f"block {block_id} is pending or has a tier key but has no cache key")
                continue
            entry_id = self.entry_ids[block_id]
            num_cached += 1
            parent_entry_id, token_bytes, ns_key = key
            if type(token_bytes) is not bytes or len(token_bytes) != block_width or len(ns_key) != NAMESPACE_KEY_SIZE:
                raise AssertionError(f"block {block_id} has a malformed key {key!r}")
            if self._block_ids.get(key) != block_id:
                raise AssertionError(f"block {block_id}: its key maps to block {self._block_ids.get(key)}")
            if not ROOT_ENTRY_ID < entry_id < self._next_entry_id or entry_id in seen_entry_ids:
                raise AssertionError(f"block {block_id} has a bad or duplicate entry id {entry_id}")
            if not ROOT_ENTRY_ID <= parent_entry_id < entry_id:
                raise AssertionError(f"block {block_id} (entry {entry_id}) has parent entry {parent_entry_id}")
            seen_entry_ids.add(entry_id)
        if num_cached != len(self._block_ids):
            raise AssertionError(f"{len(self._block_ids)} keys indexed but {num_cached} blocks hold one")
