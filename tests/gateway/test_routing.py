"""Routing policy: chained block hashes, affinity bounded by load, random ties, others' load.

The scenarios are the ones real routers' users reported: a burst of identical prompts, one hot
shared prefix under load, unique prompts at equal load, and load another gateway put on a backend.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from gateway.routing import AffinityIndex, Router, block_hashes


@dataclass(eq=False)
class Target:
    """A backend as the router sees it: outstanding work and an affinity index."""

    name: str
    outstanding: int = 0
    others: int = 0  # work other gateways put there (from the engine's Load)
    affinity: AffinityIndex = field(default_factory=lambda: AffinityIndex(1000))

    def work(self) -> int:
        return self.outstanding + self.others


def test_block_hashes_are_chained_full_blocks_per_namespace() -> None:
    a = block_hashes(list(range(40)), 16, "m|", 32)
    b = block_hashes(list(range(32)) + [99] * 8, 16, "m|", 32)
    c = block_hashes([0] + list(range(1, 40)), 16, "m|salt", 32)
    assert len(a) == 2  # 40 tokens = 2 full blocks; the partial third is never cached
    assert a == b  # the tokens after the full blocks do not matter
    assert set(a).isdisjoint(c)  # another cache salt shares nothing
    d = block_hashes([7] + list(range(1, 40)), 16, "m|", 32)
    assert d[0] != a[0] and d[1] != a[1]  # block 1 is equal, but its prefix differs: chained
    assert len(block_hashes(list(range(1000)), 16, "m|", 4)) == 4


def test_affinity_index_is_a_bounded_lru_prefix_match() -> None:
    index = AffinityIndex(capacity=3)
    h = [bytes([i]) * 16 for i in range(5)]
    index.insert(h[:3])
    assert index.match(h) == 3 and index.match([h[3], h[0]]) == 0  # stops at the first miss
    index.insert([h[0]])  # touched: h[1] is now the oldest
    index.insert([h[3]])
    assert len(index) == 3 and index.match([h[1]]) == 0 and index.match([h[0]]) == 1


def _route(router: Router, targets: list[Target], tokens: list[int], cost: int) -> Target:
    """Routes, then counts the load at once, as Dispatcher does."""
    chosen = router.choose(targets, block_hashes(tokens, 16, "m|", 32))
    chosen.outstanding += cost
    return chosen


def test_burst_of_identical_prompts_follows_affinity_until_load_gap_then_spreads() -> None:
    targets = [Target("a"), Target("b")]
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(0))
    prompt = list(range(64))
    chosen = [_route(router, targets, prompt, cost=300) for _ in range(10)]
    first = chosen[0]
    # 300, 600, 900, 1200 on one backend; once it is > 1000 tokens above the other, it yields.
    assert chosen[:4] == [first] * 4
    assert len(set(chosen)) == 2
    assert abs(targets[0].outstanding - targets[1].outstanding) <= 1000 + 300


def test_shared_prefix_goes_to_one_backend_while_not_loaded() -> None:
    targets = [Target("a"), Target("b")]
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(1))
    system = list(range(32))
    # Sequential requests (each finished before the next): the shared prefix pins one backend.
    chosen = set()
    for i in range(20):
        target = _route(router, targets, system + [100 + i] * 5, cost=50)
        target.outstanding -= 50
        chosen.add(target.name)
    assert len(chosen) == 1


def test_unique_prompts_at_equal_load_spread_by_random_ties_not_list_order() -> None:
    targets = [Target("a"), Target("b"), Target("c")]
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(2))
    counts: Counter[str] = Counter()
    for i in range(90):
        target = _route(router, targets, [i, i + 1], cost=10)  # shorter than a block: no affinity
        target.outstanding -= 10  # finished before the next arrives: loads are always equal
        counts[target.name] += 1
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) >= 15


def test_concurrent_requests_count_load_when_routed() -> None:
    targets = [Target("a"), Target("b")]
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(3))
    chosen = [_route(router, targets, [i], cost=100).name for i in range(10)]
    assert Counter(chosen) == {"a": 5, "b": 5}  # least outstanding work alternates


def test_load_reported_by_the_engine_counts_other_gateways() -> None:
    targets = [Target("a", others=5000), Target("b")]
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(4))
    assert {_route(router, targets, [i], cost=100).name for i in range(10)} == {"b"}
    # Even a prompt whose prefix "a" holds goes to "b" while "a" is that much busier.
    prompt = list(range(48))
    targets[0].affinity.insert(block_hashes(prompt, 16, "m|", 32))
    assert _route(router, targets, prompt, cost=100).name == "b"


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        Router(1, 1.0).choose([], [])
