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

The cache is the memory service's, not the backend's: backends attached to one memory service
(they report the same ``memory_service_id`` in Info) share one ``CacheModel``, so a prefix sent to
one is a predicted hit on all of them, and the least loaded of them takes it. A memory service with
a tier below its pool (``--kv-disk-dir``) keeps blocks after the pool evicts them: the model has a
second, larger LRU for the tier, and a block found only there counts ``tier_weight`` of a pool
block (docs/design.md, "Prefix affinity across shared pools and tiers", says why 0.5).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
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

    def keep_newest(self, num_hashes: int) -> None:
        """Forgets all but the ``num_hashes`` most recently inserted hashes (none when <= 0)."""
        num_dropped = len(self._hashes) - max(0, num_hashes)
        for _ in range(num_dropped):
            self._hashes.popitem(last=False)


@dataclass(frozen=True)
class CacheMatch:
    """A prompt's leading blocks predicted in a cache: first ``num_pool_blocks + num_tier_blocks``
    blocks, each found in the pool or, failing that, in a tier."""

    num_pool_blocks: int = 0
    num_tier_blocks: int = 0

    def score(self, tier_weight: float) -> float:
        """Blocks the backend would not have to compute, a tier block counting ``tier_weight``."""
        return self.num_pool_blocks + tier_weight * self.num_tier_blocks


class CacheModel:
    """What one memory service most likely holds: its pool's blocks and its tiers' (two LRUs of hashes).

    Every block routed to the cache goes into both: a tier is written behind the pool's back
    (write-behind), so it holds the pool's blocks too, and keeps them after the pool evicts them,
    until its own, larger, capacity is spent.

    A restart of the memory service under its id (a new epoch: ``forget_restarted``) empties its pool
    and its host-RAM tier; only its disk tier keeps blocks, the most recent ones its capacity holds.

    Args:
        pool_capacity: blocks of the pool (Info.num_kv_blocks).
        tier_capacity: blocks of its largest tier (0: no tier); the tiers are inclusive (a host tier
            in front of a disk tier holds copies of the disk's blocks), so not their sum.
    """

    def __init__(self, pool_capacity: int, tier_capacity: int = 0) -> None:
        self.pool = AffinityIndex(pool_capacity)
        self.tier = AffinityIndex(tier_capacity) if tier_capacity > 0 else None

    def match(self, hashes: Sequence[bytes]) -> CacheMatch:
        """The leading ``hashes`` found, each in the pool if there, else in the tier; stops at the first miss."""
        num_pool = num_tier = 0
        for digest in hashes:
            if self.pool.match((digest,)):
                num_pool += 1
            elif self.tier is not None and self.tier.match((digest,)):
                num_tier += 1
            else:
                break
        return CacheMatch(num_pool, num_tier)

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Records that the cache now holds these blocks (most recently used in both LRUs)."""
        self.pool.insert(hashes)
        if self.tier is not None:
            self.tier.insert(hashes)

    def resize(self, pool_capacity: int, tier_capacity: int) -> None:
        """Bounds the model by the capacities the backend reported (a tier may appear or go)."""
        self.pool.resize(pool_capacity)
        if tier_capacity <= 0:
            self.tier = None
        elif self.tier is None:
            self.tier = AffinityIndex(tier_capacity)
        else:
            self.tier.resize(tier_capacity)

    def forget_pool(self) -> None:
        """Forgets the pool's blocks (a backend of an unnamed memory service failed: its cache may
        be gone); the tier's stay."""
        self.pool.clear()

    def forget_restarted(self, disk_capacity: int) -> None:
        """The memory service restarted (a new epoch under its id): its pool and host tier are empty,
        its disk tier holds at most its ``disk_capacity`` blocks, the most recently written. So the
        pool's blocks are forgotten, and the tier model keeps its ``disk_capacity`` newest blocks
        (none without a disk tier): what was predicted in the pool and is among them is predicted
        in the tier from now on (every block routed here went into both)."""
        self.pool.clear()
        if self.tier is not None:
            self.tier.keep_newest(disk_capacity)


class RouteTarget(Protocol):
    """What the router needs of a backend."""

    cache: CacheModel

    def work(self) -> int:
        """Outstanding tokens (prompts to prefill plus tokens to generate), all gateways together."""
        ...


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes, and why (for the routing metrics).

    Attributes:
        target: the chosen backend.
        match: what its cache was predicted to hold of the prompt.
        yielded: a backend with a better prediction was passed over because it was too loaded.
    """

    target: RouteTarget
    match: CacheMatch
    yielded: bool

    @property
    def prediction(self) -> str:
        """"pool" (blocks predicted in the pool only), "tier" (some only in a tier) or "none"."""
        if self.match.num_tier_blocks:
            return "tier"
        return "pool" if self.match.num_pool_blocks else "none"


_NO_MATCH = CacheMatch()


class Router:
    """Picks the backend for each request.

    Args:
        max_load_gap: affinity yields when its backend's work exceeds the least loaded one's by
            more than this many tokens ...
        max_load_ratio: ... and is more than this factor of it.
        tier_weight: what a block predicted only in a tier is worth, a pool block being worth 1.
        rng: random source for tie breaks (seeded in tests).
    """

    def __init__(self, max_load_gap: int, max_load_ratio: float, rng: random.Random | None = None,
                 tier_weight: float = 0.5) -> None:
        if not 0.0 <= tier_weight <= 1.0:
            raise ValueError(f"tier_weight must be in [0, 1], got {tier_weight}")
        self.max_load_gap = max_load_gap
        self.max_load_ratio = max_load_ratio
        self.tier_weight = tier_weight
        self._rng = rng or random.Random()

    def is_imbalanced(self, work: int, min_work: int) -> bool:
        """Whether ``work`` is so far above ``min_work`` that affinity must yield."""
        return work - min_work > self.max_load_gap and work > self.max_load_ratio * min_work

    def choose(self, candidates: Sequence[RouteTarget], hashes: Sequence[bytes]) -> RouteTarget:
        """``decide``'s backend."""
        return self.decide(candidates, hashes).target

    def decide(self, candidates: Sequence[RouteTarget], hashes: Sequence[bytes]) -> RouteDecision:
        """The backend for a prompt with these block hashes; records the blocks in its cache model.

        Among the backends whose load is not imbalanced (the least loaded one never is), the one
        with the best predicted cache score; among equal scores the least loaded; among equal
        loads one at random. With no prediction anywhere that is simply the least loaded backend.
        The caller must count the request's load on the result before it awaits anything.

        Raises:
            ValueError: no candidates (the caller answers UNAVAILABLE before calling).
        """
        if not candidates:
            raise ValueError("no backend to choose from")
        work = [target.work() for target in candidates]
        min_work = min(work)
        # Backends sharing one memory service share one CacheModel: match each model once.
        matches_by_model: dict[int, CacheMatch] = {}
        matches = []
        for target in candidates:
            key = id(target.cache)
            if key not in matches_by_model:
                matches_by_model[key] = target.cache.match(hashes) if hashes else _NO_MATCH
            matches.append(matches_by_model[key])
        scores = [m.score(self.tier_weight) for m in matches]
        eligible = [i for i, w in enumerate(work) if not self.is_imbalanced(w, min_work)]
        best = max(scores[i] for i in eligible)
        best_ids = [i for i in eligible if scores[i] == best]
        least = min(work[i] for i in best_ids)
        pick = self._rng.choice([i for i in best_ids if work[i] == least])
        chosen = candidates[pick]
        chosen.cache.insert(hashes)
        return RouteDecision(chosen, matches[pick], yielded=best < max(scores))
