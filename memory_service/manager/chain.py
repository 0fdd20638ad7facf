"""The tier's block keys: a chained BLAKE2b hash of (model identity, namespace, every token so far).

The pool's prefix cache names a block's parent by an entry id that lives as long as the process
(prefix_cache.py says why). A tier outlives the process, so its key must be computable from the
content alone: block ``i`` of a prompt is keyed by

    h_0 = BLAKE2b(identity digest || namespace key)           (identity: TierIdentity.digest)
    h_i = BLAKE2b(h_{i-1} || token bytes of block i)

so equal prefixes of one model and one namespace give equal keys, in any process, and a block's key
stands for its whole prefix. Why a digest here, when the prefix cache refuses one: the tier cannot
compare the whole prefix on lookup (it is not stored), so a collision must be unreachable rather
than merely harmless; a 256-bit digest makes it so (as vLLM's and LMCache's persistent keys do).
Its cost, ~1 us a block, is paid only by clients that use a tier.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

HASH_SIZE = 32  # bytes of a block key


class BlockOrigin(NamedTuple):
    """What a tier block's key stands for, kept with its bytes so that a restarted service can say
    which prefix a block file holds (its KV events, manager/kv_events.py): the key of the block
    before it (``root_hash`` for a first block) and its own tokens.

    It checks itself: ``is_of(key)`` holds only for the origin the key was chained from, so a torn or
    foreign origin is never believed (the block is then served, but never announced).
    """

    parent_key: bytes
    token_bytes: bytes  # encoded (token_encoding), block_size tokens

    def is_of(self, key: bytes) -> bool:
        return hashlib.blake2b(self.parent_key + self.token_bytes, digest_size=HASH_SIZE).digest() == key


def root_hash(identity_digest: bytes, ns_key: bytes) -> bytes:
    """The parent key of a namespace's first block.

    Args:
        identity_digest: ``TierIdentity.digest`` of the model and layout.
        ns_key: ``prefix_cache.namespace_key`` of the namespace.
    """
    return hashlib.blake2b(identity_digest + ns_key, digest_size=HASH_SIZE).digest()


def chain_hashes(parent: bytes, token_bytes: bytes, block_width: int, num_blocks: int) -> list[bytes]:
    """Keys of the first ``num_blocks`` full blocks of ``token_bytes``, chained from ``parent``.

    Args:
        parent: the key of the block before them (``root_hash`` for a sequence's first block).
        token_bytes: encoded token ids (``token_encoding``), at least ``num_blocks`` blocks of them.
        block_width: bytes per block (block_size * TOKEN_WIDTH).
        num_blocks: how many keys.

    Returns:
        One key per block, in order.
    """
    hashes: list[bytes] = []
    blake2b = hashlib.blake2b
    for start in range(0, num_blocks * block_width, block_width):
        parent = blake2b(parent + token_bytes[start : start + block_width], digest_size=HASH_SIZE).digest()
        hashes.append(parent)
    return hashes
