"""Routing policy: chained block hashes, affinity bounded by load, random ties, others' load.

The scenarios are the ones real routers' users reported: a burst of identical prompts, one hot
shared prefix under load, unique prompts at equal load, and load another gateway put on a backend.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from gateway.backend.routing import AffinityIndex, CacheMatch, CacheModel, Router, block_hashes


@dataclass(eq=False)
class Target:
    """A backend as the router sees it: outstanding work and a model of its memory service's cache."""

    name: str
    outstanding: int = 0
    others: int = 0  # work other gateways put there (from the engine's Load)
    cache: CacheModel = field(default_factory=lambda: CacheModel(1000))

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
    targets[0].cache.insert(block_hashes(prompt, 16, "m|", 32))
    assert _route(router, targets, prompt, cost=100).name == "b"


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        Router(1, 1.0).choose([], [])


# --- backends that share a memory service, and tiers below the pool ---


def _hashes(tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, 16, "m|", 32)


def test_cache_model_finds_blocks_in_the_pool_then_in_the_tier_that_outlives_it() -> None:
    model = CacheModel(pool_capacity=4, tier_capacity=12)
    old, new = _hashes(list(range(64))), _hashes(list(range(1000, 1064)))  # 4 blocks each
    model.insert(old)
    assert model.match(old) == CacheMatch(num_pool_blocks=4, num_tier_blocks=0)
    model.insert(new)  # the pool (4 blocks) evicts `old`; the tier (12) still has it
    assert model.match(old) == CacheMatch(0, 4) and model.match(new) == CacheMatch(4, 0)
    assert model.match(old[:2] + [b"?" * 16] + new) == CacheMatch(0, 2)  # a chain stops at the first miss
    without_tier = CacheModel(pool_capacity=4)
    without_tier.insert(old)
    without_tier.insert(new)
    assert without_tier.match(old) == CacheMatch(0, 0)
    model.resize(4, 0)  # the tier went away (Info no longer lists it)
    assert model.match(old) == CacheMatch(0, 0)
    assert CacheMatch(3, 2).score(0.5) == 4.0


def test_backends_sharing_a_memory_service_are_all_predicted_hits_and_the_least_loaded_takes_it() -> None:
    shared = CacheModel(1000)
    targets = [Target("a", cache=shared), Target("b", cache=shared)]
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(5))
    prompt = list(range(64))
    first = router.decide(targets, _hashes(prompt))
    assert first.prediction == "none"
    first.target.outstanding += 300  # still streaming when the same prefix comes again
    second = router.decide(targets, _hashes(prompt))
    assert second.prediction == "pool" and second.match == CacheMatch(4, 0)
    assert second.target is not first.target and not second.yielded  # a hit on the idle one: no trade-off


def test_separate_memory_services_keep_affinity_to_the_one_that_served_the_prefix() -> None:
    targets = [Target("a"), Target("b")]  # a cache model each
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(6))
    prompt = list(range(64))
    first = router.decide(targets, _hashes(prompt))
    first.target.outstanding += 300
    second = router.decide(targets, _hashes(prompt))
    assert second.target is first.target and second.prediction == "pool"
    other = next(t for t in targets if t is not first.target)
    assert other.cache.match(_hashes(prompt)) == CacheMatch(0, 0)


def test_a_tier_hit_counts_below_a_pool_hit() -> None:
    prompt = list(range(64))  # 4 blocks
    hashes = _hashes(prompt)
    in_tier, in_pool, cold = Target("tier", cache=CacheModel(4, 100)), Target("pool"), Target("cold")
    in_tier.cache.insert(hashes)
    in_tier.cache.insert(_hashes(list(range(5000, 5064))))  # evicts the prompt from its pool only
    in_pool.cache.insert(hashes[:3])
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(7), tier_weight=0.5)
    # 3 pool blocks (3.0) beat 4 tier blocks (2.0), which beat nothing.
    decision = router.decide([in_tier, in_pool, cold], hashes)
    assert decision.target is in_pool and decision.prediction == "pool"
    in_pool.cache = CacheModel(1000)
    in_pool.cache.insert(hashes[:1])  # 1 pool block (1.0) loses to 4 tier blocks (2.0)
    decision = router.decide([in_tier, in_pool, cold], hashes)
    assert decision.target is in_tier and decision.prediction == "tier" and decision.match == CacheMatch(0, 4)
    # A weight of 0 ignores tiers: the one pool block wins.
    in_tier.cache = CacheModel(4, 100)
    in_tier.cache.insert(hashes)
    in_tier.cache.insert(_hashes(list(range(5000, 5064))))
    assert Router(1000, 2.0, random.Random(8), tier_weight=0.0).decide([in_tier, in_pool, cold], hashes).target \
        is in_pool


def test_affinity_yields_to_load_and_takes_the_best_prediction_among_the_balanced() -> None:
    prompt = list(range(64))
    hashes = _hashes(prompt)
    hot, tiered, idle = Target("hot", outstanding=5000), Target("tiered", cache=CacheModel(4, 100)), Target("idle")
    hot.cache.insert(hashes)
    tiered.cache.insert(hashes)
    tiered.cache.insert(_hashes(list(range(5000, 5064))))
    tiered.outstanding = 500  # within max_load_gap of the idle one
    router = Router(max_load_gap=1000, max_load_ratio=2.0, rng=random.Random(9))
    decision = router.decide([hot, tiered, idle], hashes)
    # The pool hit is too loaded; the tier hit is not: it wins over the idle backend with nothing.
    assert decision.target is tiered and decision.prediction == "tier" and decision.yielded
    tiered.outstanding = 1500  # now it is too loaded as well: the least loaded takes it, cold
    decision = router.decide([hot, tiered, idle], hashes)
    assert decision.target is idle and decision.prediction == "none" and decision.yielded


def test_tier_weight_is_validated() -> None:
    with pytest.raises(ValueError, match="tier_weight"):
        Router(1, 1.0, tier_weight=1.5)


def test_shared_caches_give_backends_of_one_memory_service_one_model_sized_by_its_info() -> None:
    from gateway.backend.pool import SharedCaches
    from pagedserve.compute.v1 import compute_pb2

    def info(memory_service_id: str, tier_blocks: int = 0) -> compute_pb2.InfoResponse:
        tiers = [compute_pb2.KvTier(kind="disk", capacity_bytes=tier_blocks * 64, capacity_blocks=tier_blocks)]
        return compute_pb2.InfoResponse(num_kv_blocks=4, memory_service_id=memory_service_id,
                                        kv_tiers=tiers if tier_blocks else [])

    caches = SharedCaches()
    a = caches.model_for("a:1", info("ms-1", tier_blocks=50))
    assert caches.model_for("b:1", info("ms-1", tier_blocks=50)) is a
    assert caches.model_for("c:1", info("ms-2")) is not a
    assert a.pool.capacity == 4 and a.tier is not None and a.tier.capacity == 50
    # No memory service named (an older compute service): a model of its own, per backend.
    old_x, old_y = caches.model_for("x:1", compute_pb2.InfoResponse()), caches.model_for("y:1", None)
    assert old_x is not old_y and old_x.tier is None
    # A backend whose memory service restarted under a new id gets a fresh model; the old one is
    # dropped once no backend names it.
    a.insert([b"k" * 16])
    assert caches.model_for("a:1", info("ms-3")).match([b"k" * 16]) == CacheMatch(0, 0)
    assert caches.model_for("b:1", info("ms-1", tier_blocks=50)) is a  # b still on ms-1
    caches.model_for("b:1", info("ms-3"))
    assert caches.model_for("z:1", info("ms-1")) is not a
    # A host tier in front of a disk tier holds copies of the disk's blocks: the largest tier bounds
    # the model, not their sum.
    both = compute_pb2.InfoResponse(num_kv_blocks=4, memory_service_id="ms-4", kv_tiers=[
        compute_pb2.KvTier(kind="host", capacity_bytes=20 * 64, capacity_blocks=20),
        compute_pb2.KvTier(kind="disk", capacity_bytes=50 * 64, capacity_blocks=50)])
    assert caches.model_for("h:1", both).tier.capacity == 50
