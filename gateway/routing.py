"""Routing: least outstanding work, prefix affinity over chained block hashes, engine-reported load.

Pure logic (no gRPC), so it is tested alone. What real routers' bug reports taught (see the notes
in the repository's shared lessons), and how each rule shows up here:

- Load is counted when a request is routed, synchronously, by the caller of ``Router.choose``
  (``Backend.acquire`` in the same event-loop step): a burst of requests arriving together sees
  each other's load, instead of all landing on the backend that looked idle before the burst.
- Ties are broken at random, never by list order: otherwise the first backend takes every unique
  prompt whenever loads are equal (which, at low load, is always).
- Affinity yields to load: a backend that holds a prompt's prefix wins only while its load is
  within ``max_load_gap`` tokens *or* ``max_load_ratio`` times of the least loaded backend's, so
  one hot shared prefix cannot pin all traffic on one backend until it queues.
- A backend's load is its work from this gateway plus the work the engine reports that is not
  this gateway's (other gateways' requests), so several gateways do not each see only their share.

The affinity index predicts the backend's prefix cache: it keys full prompt blocks by a chained
hash of (previous block's hash, the block's token ids, namespace), the shape of the memory
service's prefix-cache key, with the backend's block size, so "the index has the first k blocks"
means "the backend most likely has them cached". It is an LRU bounded by the blocks the backend
reports, because a backend cannot cache more than that either.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


def block_hashes(token_ids: Sequence[int], block_size: int, namespace: str, max_blocks: int) -> list[bytes]:
    """Chained hashes of the prompt's leading full blocks.

    Args:
        token_ids: the prompt.
        block_size: tokens per KV block (the backend's).
        namespace: requests share cache entries only within one namespace (model + cache salt).
        max_blocks: hash at most this many leading blocks.

    Returns:
        One 16-byte digest per full block, ``min(len(token_ids) // block_size, max_blocks)`` of them;
        digest i depends on blocks 0..i, so equal digests mean equal prefixes.
    """
    num_blocks = min(len(token_ids) // block_size, max_blocks)
    salt = namespace.encode()
    digests: list[bytes] = []
    parent = b""
    for start in range(0, num_blocks * block_size, block_size):
        block = b"".join(t.to_bytes(4, "little") for t in token_ids[start : start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16, key=salt[:64]).digest()
        digests.append(parent)
    return digests


class AffinityIndex:
    """Which prompt blocks a backend most likely holds in its prefix cache (an LRU of block hashes).

    Args:
        capacity: most hashes kept (the backend's number of KV blocks).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` present (a prefix match: chained hashes stop at the first miss)."""
        num_matched = 0
        for digest in hashes:
            if digest not in self._hashes:
                break
            num_matched += 1
        return num_matched

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Records that the backend now holds these blocks (most recently used), evicting the oldest."""
        for digest in hashes:
            self._hashes[digest] = None
            self._hashes.move_to_end(digest)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """Bounds the index by a new capacity (the backend reported its block count)."""
        self.capacity = max(1, capacity)
        self.insert(())

    def clear(self) -> None:
        """Forgets everything (the backend failed: its cache may be gone)."""
        self._hashes.clear()


class RouteTarget(Protocol):
    """What the router needs of a backend."""

    affinity: AffinityIndex

    def work(self) -> int:
        """Outstanding tokens (prompts to prefill plus tokens to generate), all gateways together."""
        ...


class Router:
    """Picks the backend for each request.

    Args:
        max_load_gap: affinity yields when its backend's work exceeds the least loaded one's by
            more than this many tokens ...
        max_load_ratio: ... and is more than this factor of it.
        rng: random source for tie breaks (seeded in tests).
    """

    def __init__(self, max_load_gap: int, max_load_ratio: float, rng: random.Random | None = None) -> None:
        self.max_load_gap = max_load_gap
        self.max_load_ratio = max_load_ratio
        self._rng = rng or random.Random()

    def is_imbalanced(self, work: int, min_work: int) -> bool:
        """Whether ``work`` is so far above ``min_work`` that affinity must yield."""
        return work - min_work > self.max_load_gap and work > self.max_load_ratio * min_work

    def choose(self, candidates: Sequence[RouteTarget], hashes: Sequence[bytes]) -> RouteTarget:
        """The backend for a prompt with these block hashes; records the blocks in its index.

        The caller must count the request's load on the result before it awaits anything.

        Raises:
            ValueError: no candidates (the caller answers UNAVAILABLE before calling).
        """
        if not candidates:
            raise ValueError("no backend to choose from")
        work = [target.work() for target in candidates]
        min_work = min(work)
        chosen: RouteTarget | None = None
        if hashes:
            matched = [target.affinity.match(hashes) for target in candidates]
            best = max(matched)
            if best > 0:
                holders = [i for i, m in enumerate(matched) if m == best]
                least = min(work[i] for i in holders)
                pick = self._rng.choice([i for i in holders if work[i] == least])
                if not self.is_imbalanced(work[pick], min_work):
                    chosen = candidates[pick]
        if chosen is None:
            chosen = candidates[self._rng.choice([i for i, w in enumerate(work) if w == min_work])]
        chosen.affinity.insert(hashes)
        return chosen
