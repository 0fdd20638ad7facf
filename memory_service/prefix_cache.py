"""Prefix cache: a content-addressed index of full KV blocks, so equal prompt prefixes share blocks.

A full block is keyed by ``(parent_entry_id, token_ids, namespace)``:

- ``token_ids`` are the block's own ``block_size`` token ids (a tuple), stored in the key itself;
- ``parent_entry_id`` identifies the cache entry of the block before it (``ROOT_ENTRY_ID`` for the
  first block of a sequence). Entry ids are handed out once per registration and never reused;
- ``namespace`` (model name + cache_salt) keeps tenants apart.

This is the chained hash of (parent hash, token ids, namespace) from docs/design.md, with one
deliberate difference: the parent is named by its entry id, not by its hash value. The dict compares
whole keys on lookup, so a hash collision can never share wrong content: not in this block (its
token ids are compared) and not in its prefix (an entry id names exactly one registration, and by
induction one prefix). The cost is that an entry whose parent was evicted becomes unreachable; it is
harmless and leaves in LRU order like any other evictable block.

The cache only indexes blocks. Reference counts, the LRU of evictable blocks and the free lists live
in the BlockManager, which calls ``drop`` when it evicts a block.
"""

from __future__ import annotations

from collections.abc import Sequence

# Parent entry id of a sequence's first block.
ROOT_ENTRY_ID = 0

CacheKey = tuple[int, tuple[int, ...], str]  # (parent_entry_id, token_ids of the block, namespace)


class PrefixCache:
    """Maps the content of full blocks to the block ids that hold it.

    Invariants (checked by ``check_integrity``): a block has a key iff it has a non-zero entry id iff
    the index maps that key to that block; entry ids are unique; a parent entry id is always smaller
    than its child's (the parent registered first).

    Args:
        num_blocks: number of block ids, ``[0, num_blocks)``.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._block_ids: dict[CacheKey, int] = {}
        # Per block id; plain lists indexed by block id keep the hot path free of per-block objects.
        self.block_keys: list[CacheKey | None] = [None] * num_blocks
        self.entry_ids: list[int] = [ROOT_ENTRY_ID] * num_blocks  # ROOT_ENTRY_ID = not cached
        self._next_entry_id = ROOT_ENTRY_ID + 1

    def __len__(self) -> int:
        return len(self._block_ids)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a registered full block (in use or evictable).

        Args:
            block_id: the block.

        Returns:
            True if the block has a cache key.
        """
        return self.block_keys[block_id] is not None

    def match(self, token_ids: tuple[int, ...], namespace: str, max_num_blocks: int) -> tuple[list[int], int]:
        """Finds the longest cached prefix of ``token_ids``, block by block. Changes nothing.

        Args:
            token_ids: the prompt (a tuple: its slices are the keys' token tuples).
            namespace: the prompt's namespace.
            max_num_blocks: look at most this many leading full blocks.

        Returns:
            The cached block ids of the prefix, in order, and the entry id of the last one
            (``ROOT_ENTRY_ID`` when nothing matched), the parent for the blocks that follow.
        """
        block_size = self.block_size
        get = self._block_ids.get
        entry_ids = self.entry_ids
        block_ids: list[int] = []
        parent_entry_id = ROOT_ENTRY_ID
        for start in range(0, max_num_blocks * block_size, block_size):
            block_id = get((parent_entry_id, token_ids[start : start + block_size], namespace))
            if block_id is None:
                break
            block_ids.append(block_id)
            parent_entry_id = entry_ids[block_id]
        return block_ids, parent_entry_id

    def register(self, block_ids: Sequence[int], token_ids: Sequence[int], namespace: str, parent_entry_id: int) -> int:
        """Registers blocks of one sequence that just became full.

        When an identical block is already cached (two sequences generated the same tokens), the
        sequence keeps its own block and it is not registered: no de-duplication, so block tables
        stay append-only. The chain continues from the cached twin, so the next block can still be
        registered.

        Args:
            block_ids: consecutive full blocks of one sequence, not cached yet.
            token_ids: their contents: ``block_ids[i]`` holds ``token_ids[i * block_size:(i + 1) * block_size]``.
            namespace: the sequence's namespace.
            parent_entry_id: entry id of the block before ``block_ids[0]`` in the sequence.

        Returns:
            The entry id of the last block's content, the parent for the sequence's next block.
        """
        block_size = self.block_size
        index = self._block_ids
        for i, block_id in enumerate(block_ids):
            key = (parent_entry_id, tuple(token_ids[i * block_size : (i + 1) * block_size]), namespace)
            cached_block_id = index.setdefault(key, block_id)
            if cached_block_id == block_id:
                self.block_keys[block_id] = key
                parent_entry_id = self.entry_ids[block_id] = self._next_entry_id
                self._next_entry_id += 1
            else:
                parent_entry_id = self.entry_ids[cached_block_id]
        return parent_entry_id

    def drop(self, block_id: int) -> None:
        """Forgets a cached block (it is being evicted and reused).

        Args:
            block_id: a cached block.
        """
        del self._block_ids[self.block_keys[block_id]]
        self.block_keys[block_id] = None
        self.entry_ids[block_id] = ROOT_ENTRY_ID

    def check_integrity(self) -> None:
        """Raises AssertionError if the index and the per-block keys disagree."""
        num_keyed = 0
        seen_entry_ids: set[int] = set()
        for block_id, key in enumerate(self.block_keys):
            entry_id = self.entry_ids[block_id]
            if key is None:
                if entry_id != ROOT_ENTRY_ID:
                    raise AssertionError(f"block {block_id} has entry id {entry_id} but no cache key")
                continue
            num_keyed += 1
            if self._block_ids.get(key) != block_id:
                raise AssertionError(f"block {block_id}'s key maps to block {self._block_ids.get(key)}")
            parent_entry_id, token_ids, namespace = key
            if type(token_ids) is not tuple or len(token_ids) != self.block_size or type(namespace) is not str:
                raise AssertionError(f"block {block_id} has a malformed key {key!r}")
            if not ROOT_ENTRY_ID < entry_id < self._next_entry_id or entry_id in seen_entry_ids:
                raise AssertionError(f"block {block_id} has a bad or duplicate entry id {entry_id}")
            if not 0 <= parent_entry_id < entry_id:
                raise AssertionError(f"block {block_id} (entry {entry_id}) has parent entry {parent_entry_id}")
            seen_entry_ids.add(entry_id)
        if num_keyed != len(self._block_ids):
            raise AssertionError(f"{len(self._block_ids)} keys indexed but {num_keyed} blocks hold a key")
