"""Prefix cache: a content-addressed index of full KV blocks, so equal prompt prefixes share blocks.

A full block's content is its key ``(parent_entry_id, token_bytes, namespace)``:

- ``token_bytes``: the block's own ``block_size`` token ids, encoded by ``encode_token_ids``
  (``TOKEN_WIDTH`` = 4 bytes each). Bytes rather than a tuple of ints: a bytes object hashes and
  compares as one buffer and caches its hash, and freeing it touches no int objects;
- ``parent_entry_id``: the cache entry of the block before it in the sequence (``ROOT_ENTRY_ID``
  for a first block). Each registration gets a new entry id, never reused;
- ``namespace``: model name + cache_salt, so tenants never share.

The hash of the key is the chained hash of (parent, token ids, namespace) of docs/design.md. The
index is a dict keyed by the whole key, and a dict compares keys on lookup: the token ids are stored
with the block and a hash collision can never share wrong content. Not in the block's prefix either:
the parent is named by its entry id, which stands for exactly one registration and, by induction
from the root, exactly one prefix (a parent named by its hash would let two prefixes whose hashes
collide adopt each other's children). The price: when a parent is evicted, its cached children can
no longer be reached; they are harmless and leave in LRU order like any other evictable block.

The cache only indexes blocks. Reference counts, the LRU of evictable blocks and the free lists live
in the BlockManager, which has ``evict`` take blocks off an LRU when it needs them.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

# Parent entry id of a sequence's first block.
ROOT_ENTRY_ID = 0

CacheKey = tuple[int, bytes, str]  # (parent_entry_id, token_bytes of the block, namespace)

# Token ids are unsigned 32-bit: an id that does not fit (negative, >= 2**32, not an int) cannot be
# encoded, which is how the block manager validates them in one pass in C.
_TOKEN_TYPECODE = "I"
TOKEN_WIDTH = array(_TOKEN_TYPECODE).itemsize  # bytes per token id


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Encodes token ids for cache keys.

    Args:
        token_ids: ints in ``[0, 2**32)``.

    Returns:
        ``TOKEN_WIDTH`` bytes per token.

    Raises:
        OverflowError: an id is negative or too large.
        TypeError: an id is not an int.
    """
    return array(_TOKEN_TYPECODE, token_ids).tobytes()


def decode_token_ids(token_bytes: bytes) -> list[int]:
    """Inverse of ``encode_token_ids`` (debugging and tests)."""
    token_ids = array(_TOKEN_TYPECODE)
    token_ids.frombytes(token_bytes)
    return token_ids.tolist()


class PrefixCache:
    """Maps the content of full blocks to the block ids that hold it.

    Invariants (``check_integrity``): a block has a key iff the index maps that key to it; the entry
    ids of blocks with a key are unique; a parent entry id is smaller than its child's (the parent
    registered first). A block without a key has a stale entry id, never read.

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
        self._next_entry_id = ROOT_ENTRY_ID + 1

    def __len__(self) -> int:
        return len(self._block_ids)

    def match(self, token_bytes: bytes, namespace: str, max_num_blocks: int) -> tuple[list[int], int]:
        """Finds the longest cached prefix of a prompt, block by block. Changes nothing.

        Args:
            token_bytes: the prompt, encoded.
            namespace: the prompt's namespace.
            max_num_blocks: look at most this many leading full blocks.

        Returns:
            The cached block ids of the prefix, in order, and the entry id of the last one
            (``ROOT_ENTRY_ID`` when nothing matched): the parent of the blocks that follow.
        """
        block_width = self.block_size * TOKEN_WIDTH
        get = self._block_ids.get
        entry_ids = self.entry_ids
        block_ids: list[int] = []
        parent_entry_id = ROOT_ENTRY_ID
        for start in range(0, max_num_blocks * block_width, block_width):
            block_id = get((parent_entry_id, token_bytes[start : start + block_width], namespace))
            if block_id is None:
                break
            block_ids.append(block_id)
            parent_entry_id = entry_ids[block_id]
        return block_ids, parent_entry_id

    def register(
        self, block_ids: Sequence[int], token_bytes: bytes, start: int, namespace: str, parent_entry_id: int
    ) -> int:
        """Registers blocks of one sequence that just became full.

        When an identical block is already cached (two sequences generated the same tokens), the
        sequence keeps its own block and it is not registered: no de-duplication, so block tables
        stay append-only. The chain goes on from the cached twin, so later blocks still register.

        Args:
            block_ids: consecutive blocks of one sequence, now full, not cached.
            token_bytes: encoded tokens of the sequence (or of a tail of it) holding their contents.
            start: the token index in ``token_bytes`` where ``block_ids[0]`` begins; the blocks follow.
            namespace: the sequence's namespace.
            parent_entry_id: entry id of the content of the block before ``block_ids[0]``.

        Returns:
            The entry id of the last block's content: the parent of the sequence's next block.
        """
        block_width = self.block_size * TOKEN_WIDTH
        start *= TOKEN_WIDTH
        setdefault = self._block_ids.setdefault
        block_keys, entry_ids = self.block_keys, self.entry_ids
        next_entry_id = self._next_entry_id
        for block_id in block_ids:
            key = (parent_entry_id, token_bytes[start : start + block_width], namespace)
            start += block_width
            cached_block_id = setdefault(key, block_id)
            if cached_block_id == block_id:
                block_keys[block_id] = key
                parent_entry_id = entry_ids[block_id] = next_entry_id
                next_entry_id += 1
            else:
                parent_entry_id = entry_ids[cached_block_id]
        self._next_entry_id = next_entry_id
        return parent_entry_id

    def evict(self, lru: OrderedDict[int, None], num_blocks: int) -> list[int]:
        """Takes the least recently used blocks off an LRU and forgets them, for reuse.

        Args:
            lru: cached, unreferenced blocks, least recently used first (owned by the BlockManager).
            num_blocks: how many to evict (at most ``len(lru)``).

        Returns:
            The evicted block ids, least recently used first.
        """
        index, block_keys, popitem = self._block_ids, self.block_keys, lru.popitem
        evicted = []
        for _ in range(num_blocks):
            block_id = popitem(False)[0]  # last=False: the least recently used; positional is faster
            del index[block_keys[block_id]]
            block_keys[block_id] = None  # its entry id goes stale: read only while a key is set
            evicted.append(block_id)
        return evicted

    def check_integrity(self) -> None:
        """Raises AssertionError if the index and the per-block keys and entry ids disagree."""
        num_cached = 0
        seen_entry_ids: set[int] = set()
        block_width = self.block_size * TOKEN_WIDTH
        for block_id, key in enumerate(self.block_keys):
            if key is None:
                continue
            entry_id = self.entry_ids[block_id]
            num_cached += 1
            parent_entry_id, token_bytes, namespace = key
            if type(token_bytes) is not bytes or len(token_bytes) != block_width or type(namespace) is not str:
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
