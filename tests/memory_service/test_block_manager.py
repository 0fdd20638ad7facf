"""Block manager, in-process: exact block ids, eviction order, sharing, copy-on-write, pools, errors.

Block size 4 throughout, so a prompt of 10 tokens is 2 full blocks and 2 tokens. Every manager made
by the ``make`` fixture gets ``check_integrity()`` when its test ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from memory_service.manager.block_manager import (
    AllocateOp,
    AppendOp,
    BlockManager,
    BlockManagerConfig,
    ForkOp,
    FreeOp,
    OpResult,
    PoolStats,
)

pytestmark = pytest.mark.unit

BS = 4
MakeManager = Callable[..., BlockManager]


@pytest.fixture
def make() -> Iterator[MakeManager]:
    """Builds managers with client "c" attached; checks each one's integrity at teardown."""
    managers: list[BlockManager] = []

    def build(
        num_blocks: int = 8, copy_block: Callable[[int, int], None] | None = None, **config: object
    ) -> BlockManager:
        config.setdefault("block_size", BS)
        manager = BlockManager(BlockManagerConfig(num_blocks=num_blocks, **config), copy_block=copy_block)
        manager.add_client("c")
        managers.append(manager)
        return manager

    yield build
    for manager in managers:
        manager.check_integrity()


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def alloc(manager: BlockManager, seq_id: str, prompt: list[int], max_new: int = 1000, **kw: object) -> OpResult:
    [result] = manager.apply("c", [AllocateOp(seq_id, prompt, max_new, **kw)])
    manager.check_integrity()
    return result


def run(manager: BlockManager, *ops: object, client: str = "c") -> list[OpResult]:
    results = manager.apply(client, list(ops))
    manager.check_integrity()
    return results


def refs(manager: BlockManager) -> list[int]:
    return [manager.ref_count(b) for b in range(manager.config.num_blocks)]


def snapshot(manager: BlockManager) -> tuple:
    """Everything an op that changed nothing must leave as it was."""
    names = ("a", "b", "keep", "fill", "high", "high2", "low", "other", "x", "y")
    tables = {s: manager.block_table("c", s) for s in names if manager.has_sequence("c", s)}
    return manager.stats(), tables, refs(manager), manager.num_available_blocks()


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": True}, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_blocks": 8, "block_size": 16.0}, "block_size"),
        ({"num_blocks": 8, "enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"num_blocks": 8, "reserved_blocks": -1}, "reserved_blocks"),
        ({"num_blocks": 8, "reserved_blocks": 8}, "reserved_blocks"),
        ({"num_blocks": 8, "reserved_min_priority": "1"}, "reserved_min_priority"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        BlockManagerConfig(**kwargs)


def test_config_pools() -> None:
    config = BlockManagerConfig(num_blocks=10, reserved_blocks=3)
    assert config.block_size == 16 and config.enable_prefix_caching and config.reserved_min_priority == 1
    assert config.num_general_blocks == 7


# --- allocate / free: exact ids ----------------------------------------------------------------


def test_fresh_manager_hands_out_increasing_ids(make: MakeManager) -> None:
    manager = make()
    a = alloc(manager, "a", tokens(0, 10))
    assert a == OpResult(True, [0, 1, 2], num_cached_tokens=0, num_new_tokens=10)
    assert alloc(manager, "b", tokens(100, 5)).block_ids == [3, 4]
    assert manager.block_table("c", "a") == [0, 1, 2]
    assert refs(manager) == [1, 1, 1, 1, 1, 0, 0, 0]


def test_freed_blocks_come_back_head_first(make: MakeManager) -> None:
    manager = make(enable_prefix_caching=False)
    alloc(manager, "a", tokens(0, 10))
    alloc(manager, "b", tokens(100, 3))
    [freed] = run(manager, FreeOp("a"))
    assert freed == OpResult(True, [0, 1, 2])
    # The free stack now holds 0, 1, 2 on top of 4..7: the next table is 0, 1, 2, 4.
    assert alloc(manager, "c", tokens(200, 13)).block_ids == [0, 1, 2, 4]
    assert manager.stats().general == PoolStats("general", 8, 3, 0, 5)


def test_max_num_new_tokens_is_a_chunk_of_the_prompt(make: MakeManager) -> None:
    manager = make()
    prompt = tokens(0, 10)
    a = alloc(manager, "a", prompt, max_new=5)
    assert (a.block_ids, a.num_cached_tokens, a.num_new_tokens) == ([0, 1], 0, 5)
    # The rest of the prompt comes as an append; it fills block 1 and opens block 2.
    assert run(manager, AppendOp("a", prompt[5:])) == [OpResult(True, [2])]
    # Block 1 was registered when the append filled it: the same prompt now hits 2 blocks.
    b = alloc(manager, "b", prompt)
    assert (b.block_ids, b.num_cached_tokens, b.num_new_tokens) == ([0, 1, 3], 8, 2)


def test_out_of_blocks_changes_nothing(make: MakeManager) -> None:
    manager = make(num_blocks=5)
    alloc(manager, "a", tokens(0, 9))  # [0, 1, 2]
    alloc(manager, "keep", tokens(50, 4))  # [3]
    before = snapshot(manager)
    assert alloc(manager, "b", tokens(100, 8)) == OpResult(False, [])
    assert not manager.has_sequence("c", "b")
    assert run(manager, AppendOp("a", tokens(9, 8))) == [OpResult(False, [])]
    assert snapshot(manager) == before
    assert alloc(manager, "b", tokens(100, 4)).block_ids == [4]


# --- prefix caching ----------------------------------------------------------------------------


def test_prefix_is_shared_zero_copy(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 10))
    b = alloc(manager, "b", tokens(0, 10))
    assert (b.block_ids, b.num_cached_tokens, b.num_new_tokens) == ([0, 1, 3], 8, 2)
    assert refs(manager)[:4] == [2, 2, 1, 1]
    stats = manager.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4)


def test_match_leaves_at_least_one_prompt_token(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 8))  # 2 full blocks, both registered
    b = alloc(manager, "b", tokens(0, 8))
    # Only (8 - 1) // 4 = 1 block may match: the last prompt token must be computed.
    assert (b.block_ids, b.num_cached_tokens, b.num_new_tokens) == ([0, 2], 4, 4)
    # b's block 2 is full and identical to a's block 1: kept (tables are append-only) but not registered.
    run(manager, FreeOp("a"), FreeOp("b"))
    general = manager.stats().general
    assert (general.num_cached_blocks, general.num_free_blocks) == (2, 6)
    c = alloc(manager, "c", tokens(0, 9))
    assert (c.block_ids[:2], c.num_cached_tokens) == ([0, 1], 8)


def test_single_block_prompt_never_hits(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 4))
    assert alloc(manager, "b", tokens(0, 4)).num_cached_tokens == 0


def test_partial_blocks_are_not_cached(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 6))
    run(manager, FreeOp("a"))
    assert manager.stats().general == PoolStats("general", 8, 7, 1, 0)
    assert alloc(manager, "b", tokens(0, 7)).num_cached_tokens == 4  # block 0 only


def test_namespaces_do_not_share(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 9), namespace="model|salt1")
    assert alloc(manager, "b", tokens(0, 9), namespace="model|salt2").num_cached_tokens == 0
    assert alloc(manager, "c", tokens(0, 9), namespace="model|salt1").num_cached_tokens == 8


def test_skip_cache_read_shares_nothing_and_still_publishes(make: MakeManager) -> None:
    """Prompt logprobs need every prompt position computed: such a sequence reads no cached block
    (nor counts as a lookup), and its own full blocks are published for later sequences."""
    manager = make(num_blocks=12)
    alloc(manager, "a", tokens(0, 10))
    b = alloc(manager, "b", tokens(0, 10), skip_cache_read=True)
    assert (b.block_ids, b.num_cached_tokens, b.num_new_tokens) == ([3, 4, 5], 0, 10)
    assert (manager.stats().prefix_cache_queries, manager.stats().prefix_cache_hits) == (10, 0)
    c = alloc(manager, "c", tokens(100, 9), skip_cache_read=True)  # a new prefix: registered
    run(manager, FreeOp("c"))
    d = alloc(manager, "d", tokens(100, 9))
    assert (d.block_ids[:2], d.num_cached_tokens) == (c.block_ids[:2], 8)


def test_a_block_matches_only_after_the_same_prefix(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    # Same second block after a different first block: no hit (the key chains the parent).
    assert alloc(manager, "b", [7, 7, 7, 7, 2, 2, 2, 2, 9]).num_cached_tokens == 0


def test_identical_blocks_of_two_sequences_chain_through_the_cached_twin(make: MakeManager) -> None:
    manager = make(num_blocks=12)
    prompt = tokens(0, 5)
    alloc(manager, "a", prompt)  # [0, 1]
    alloc(manager, "b", prompt)  # [0, 2]: block 0 shared
    run(manager, AppendOp("a", [50, 51, 52]))  # fills a's block 1: registered
    run(manager, AppendOp("b", [50, 51, 52]))  # fills b's block 2: a twin of block 1, not registered
    run(manager, AppendOp("b", [53, 54, 55, 56, 57]))  # fills b's block 3, chained after block 1's entry
    assert manager.block_table("c", "b") == [0, 2, 3, 4]
    c = alloc(manager, "c", [*prompt, 50, 51, 52, 53, 54, 55, 56, 99])
    assert (c.block_ids[:3], c.num_cached_tokens) == ([0, 1, 3], 12)


def test_evictable_blocks_go_lru_tail_first(make: MakeManager) -> None:
    manager = make(num_blocks=5)
    alloc(manager, "a", tokens(0, 12))  # [0, 1, 2], all full and registered
    run(manager, FreeOp("a"))  # LRU: 2, 1, 0
    assert manager.stats().general == PoolStats("general", 5, 2, 3, 0)
    # The plain free blocks first, then evictions: a's tail (2) before its head.
    assert alloc(manager, "b", tokens(100, 12)).block_ids == [3, 4, 2]
    assert manager.stats().num_evictions == 1
    run(manager, FreeOp("b"))  # LRU: 1, 0, 2, 4, 3
    # Blocks 0 and 1 survived and are shared; the new block evicts the oldest of the rest.
    c = alloc(manager, "c", tokens(0, 9), max_new=1)
    assert (c.block_ids, c.num_cached_tokens) == ([0, 1, 2], 8)
    assert manager.stats().num_evictions == 2


def test_lru_order_follows_free_order_across_sequences(make: MakeManager) -> None:
    manager = make(num_blocks=6)
    alloc(manager, "a", tokens(0, 8))  # [0, 1]
    alloc(manager, "b", tokens(100, 8))  # [2, 3]
    run(manager, FreeOp("b"), FreeOp("a"))  # LRU: 3, 2, 1, 0
    assert alloc(manager, "c", tokens(200, 16)).block_ids == [4, 5, 3, 2]
    assert alloc(manager, "d", tokens(300, 4)).block_ids == [1]
    assert manager.stats().num_evictions == 3


def test_sharing_an_evictable_block_takes_it_off_the_lru(make: MakeManager) -> None:
    manager = make(num_blocks=5)
    alloc(manager, "a", tokens(0, 9))  # [0, 1, 2]
    alloc(manager, "keep", tokens(50, 1))  # [3]
    run(manager, FreeOp("a"))  # LRU: 1, 0; free: 4, 2
    assert manager.num_available_blocks() == (4, 0)
    # Sharing blocks 0 and 1 takes them off the LRU, so they cannot also be evicted for this op:
    # 3 new blocks do not fit in the 2 free ones, and the op changes nothing.
    before = snapshot(manager)
    assert alloc(manager, "b", tokens(0, 17)) == OpResult(False, [])
    assert snapshot(manager) == before
    b = alloc(manager, "b", tokens(0, 16))
    assert (b.block_ids, b.num_cached_tokens) == ([0, 1, 2, 4], 8)
    assert manager.stats().general == PoolStats("general", 5, 0, 0, 5)


def test_cached_children_of_an_evicted_parent_are_unreachable(make: MakeManager) -> None:
    manager = make(num_blocks=6)
    prompt = tokens(0, 5)
    alloc(manager, "a", prompt)  # [0, 1]
    alloc(manager, "b", prompt)  # [0, 2]
    run(manager, AppendOp("a", [50, 51, 52]), AppendOp("b", [50, 51, 52, 53, 54, 55, 56, 57]))
    assert manager.block_table("c", "b") == [0, 2, 3, 4]  # 2: unregistered twin of 1; 3: child of 1's entry
    run(manager, FreeOp("a"))  # LRU: 1
    run(manager, FreeOp("b"))  # LRU: 1, 3, 0; free: 5, 4, 2 (4 is partial, 2 has no key)
    assert manager.stats().general == PoolStats("general", 6, 3, 3, 0)
    # 4 blocks: the 3 free ones, then block 1 is evicted; 3 stays cached under 1's old entry.
    alloc(manager, "x", tokens(100, 16))
    assert manager.block_table("c", "x") == [2, 4, 5, 1]
    run(manager, FreeOp("x"))  # LRU: 3, 0, 1, 5, 4, 2
    # The same 12 tokens again: block 0 hits; block 1's content is gone, and block 3 must not be
    # found through it even though it holds the right tokens after the right tokens. Unreachable,
    # it is simply the oldest in the LRU and the first to be evicted.
    c = alloc(manager, "c", [*prompt, 50, 51, 52, 53, 54, 55, 56, 99])
    assert (c.block_ids, c.num_cached_tokens) == ([0, 3, 1, 5], 4)


# Commit before share. Client "c" fills blocks; "d" shares them only once a later
# batch of "c" (or a commit) acknowledges that their K/V is written.


def test_another_client_does_not_share_blocks_before_their_writer_commits(make: MakeManager) -> None:
    manager = make()
    manager.add_client("d")
    alloc(manager, "a", tokens(0, 9))  # [0, 1, 2]: blocks 0 and 1 fill, pending
    [early] = run(manager, AllocateOp("b", tokens(0, 9), 9), client="d")
    assert (early.num_cached_tokens, early.block_ids) == (0, [3, 4, 5])
    run(manager)  # c's next step: its earlier writes are done
    [late] = run(manager, AllocateOp("b2", tokens(0, 9), 9), client="d")
    assert (late.num_cached_tokens, late.block_ids) == (8, [0, 1, 6])


def test_a_client_shares_its_own_pending_blocks_at_once(make: MakeManager) -> None:
    manager = make()
    a, b = run(manager, AllocateOp("a", tokens(0, 9), 9), AllocateOp("b", tokens(0, 9), 9))
    assert (b.num_cached_tokens, b.block_ids[:2]) == (8, a.block_ids[:2])


def test_blocks_of_a_client_released_before_committing_are_never_shared(make: MakeManager) -> None:
    """The writer died before writing: its blocks go back to the free list, not to the cache."""
    manager = make()
    manager.add_client("d")
    manager.apply("d", [AllocateOp("w", tokens(0, 9), 9, namespace="m|public")])  # [0, 1, 2]
    manager.release_client("d")
    assert manager.stats().general == PoolStats("general", 8, 8, 0, 0)
    [r] = run(manager, AllocateOp("r", tokens(0, 9), 9, namespace="m|public"))
    assert (r.num_cached_tokens, r.block_ids) == (0, [0, 1, 2])


def test_blocks_filled_by_a_sequence_freed_in_the_same_batch_are_never_shared(make: MakeManager) -> None:
    manager = make()
    manager.add_client("d")
    run(manager, AllocateOp("a", tokens(0, 9), 9), FreeOp("a"))
    run(manager)  # commits nothing: a's blocks were dropped from the cache with it
    assert manager.stats().general == PoolStats("general", 8, 8, 0, 0)
    [r] = run(manager, AllocateOp("r", tokens(0, 9), 9), client="d")
    assert r.num_cached_tokens == 0


def test_commit_publishes_and_keeps_working_after_free(make: MakeManager) -> None:
    manager = make()
    manager.add_client("d")
    alloc(manager, "a", tokens(0, 9))
    manager.commit("c")
    manager.check_integrity()
    run(manager, FreeOp("a"))  # committed blocks stay cached when freed
    [r] = run(manager, AllocateOp("r", tokens(0, 9), 9), client="d")
    assert r.num_cached_tokens == 8
    with pytest.raises(ValueError, match="who"):
        manager.commit("who")


def test_prefix_caching_disabled(make: MakeManager) -> None:
    manager = make(enable_prefix_caching=False)
    alloc(manager, "a", tokens(0, 9))
    assert alloc(manager, "b", tokens(0, 9)).block_ids == [3, 4, 5]
    run(manager, FreeOp("a"), FreeOp("b"))
    stats = manager.stats()
    assert stats.general.num_cached_blocks == 0 and stats.prefix_cache_queries == 0


# --- fork and copy-on-write ---------------------------------------------------------------------


def test_fork_shares_and_append_copies_the_shared_partial_block(make: MakeManager) -> None:
    copies: list[tuple[int, int]] = []
    manager = make(copy_block=lambda src, dst: copies.append((src, dst)))
    alloc(manager, "a", tokens(0, 6))  # [0, 1], block 1 holds 2 tokens
    assert run(manager, ForkOp("a", "b")) == [OpResult(True, [0, 1])]
    assert refs(manager)[:3] == [2, 2, 0]
    # a writes into block 1, which b also holds: a gets a copy, b keeps the original.
    assert run(manager, AppendOp("a", [6])) == [OpResult(True, [], copies=[(1, 2)])]
    assert copies == [(1, 2)]
    assert manager.block_table("c", "a") == [0, 2] and manager.block_table("c", "b") == [0, 1]
    assert refs(manager)[:3] == [2, 1, 1]
    # b is now alone in block 1: no copy. Crossing into a new block appends one.
    assert run(manager, AppendOp("b", [7, 8, 9])) == [OpResult(True, [3])]
    assert copies == [(1, 2)] and manager.stats().num_copy_on_writes == 1


def test_copy_on_write_comes_before_the_appended_blocks(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 5))  # [0, 1]
    run(manager, ForkOp("a", "b"))
    assert run(manager, AppendOp("a", tokens(5, 8))) == [OpResult(True, [3, 4], copies=[(1, 2)])]
    assert manager.block_table("c", "a") == [0, 2, 3, 4]


def test_fork_of_full_blocks_needs_no_copy(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 8))
    run(manager, ForkOp("a", "b"))
    assert run(manager, AppendOp("a", [8]), AppendOp("b", [9])) == [OpResult(True, [2]), OpResult(True, [3])]
    assert manager.stats().num_copy_on_writes == 0


def test_copy_on_write_without_free_blocks_fails_cleanly(make: MakeManager) -> None:
    manager = make(num_blocks=2)
    alloc(manager, "a", tokens(0, 6))
    run(manager, ForkOp("a", "b"))
    before = snapshot(manager)
    assert run(manager, AppendOp("a", [6])) == [OpResult(False, [])]
    assert snapshot(manager) == before


def test_a_failing_copy_block_raises_and_gives_the_blocks_back(make: MakeManager) -> None:
    def broken_copy(src: int, dst: int) -> None:
        raise OSError("device lost")

    manager = make(copy_block=broken_copy)
    alloc(manager, "a", tokens(0, 6))
    run(manager, ForkOp("a", "b"))
    before = snapshot(manager)
    with pytest.raises(OSError, match="device lost"):
        manager.apply("c", [AppendOp("a", tokens(6, 4))])
    manager.check_integrity()
    assert snapshot(manager) == before


def test_freeing_a_fork_keeps_the_parent_blocks(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 6))
    run(manager, ForkOp("a", "b"), FreeOp("a"))
    assert manager.block_table("c", "b") == [0, 1] and refs(manager)[:2] == [1, 1]
    assert run(manager, AppendOp("b", [6])) == [OpResult(True, [])]  # alone in block 1 now: no copy


# --- priority-reserved pool ---------------------------------------------------------------------


def test_low_priority_cannot_take_reserved_blocks(make: MakeManager) -> None:
    manager = make(num_blocks=6, reserved_blocks=2)  # general 0-3, reserved 4-5
    assert alloc(manager, "a", tokens(0, 16)).block_ids == [0, 1, 2, 3]
    assert alloc(manager, "low", tokens(100, 3)) == OpResult(False, [])
    assert alloc(manager, "high", tokens(100, 3), priority=1).block_ids == [4]
    assert run(manager, AppendOp("high", tokens(103, 2))) == [OpResult(True, [5])]
    stats = manager.stats()
    assert stats.pools == (PoolStats("general", 4, 0, 0, 4), PoolStats("reserved", 2, 0, 0, 2))
    assert manager.num_available_blocks() == (0, 0)


def test_high_priority_takes_general_blocks_first_including_evictions(make: MakeManager) -> None:
    manager = make(num_blocks=6, reserved_blocks=2)
    alloc(manager, "a", tokens(0, 12))  # [0, 1, 2]
    run(manager, FreeOp("a"))  # general: free 3, LRU 2, 1, 0
    high = alloc(manager, "high", tokens(100, 24), priority=5)
    assert high.block_ids == [3, 2, 1, 0, 4, 5]
    assert manager.stats().num_evictions == 3


def test_reserved_pool_has_its_own_lru_and_shares_across_priorities(make: MakeManager) -> None:
    manager = make(num_blocks=5, reserved_blocks=2)  # general 0-2, reserved 3-4
    alloc(manager, "fill", tokens(900, 12))  # [0, 1, 2]
    alloc(manager, "high", tokens(0, 8), priority=1)  # [3, 4], both registered
    run(manager, FreeOp("high"))  # reserved LRU: 4, 3
    assert manager.stats().reserved == PoolStats("reserved", 2, 0, 2, 0)
    assert manager.num_available_blocks() == (0, 2)
    # Low priority never takes a reserved block, evictable or not.
    before = snapshot(manager)
    assert alloc(manager, "low", tokens(500, 2)) == OpResult(False, [])
    assert snapshot(manager) == before
    # High priority evicts in the reserved pool's own LRU: high's tail (4) first.
    assert alloc(manager, "high2", tokens(500, 2), priority=1).block_ids == [4]
    # Low priority may share a cached reserved block; its new block comes from the general pool.
    run(manager, FreeOp("fill"))  # general LRU: 2, 1, 0
    low = alloc(manager, "low", tokens(0, 5), max_new=1)
    assert (low.block_ids, low.num_cached_tokens) == ([3, 2], 4)
    assert manager.stats().num_evictions == 2


def test_reserved_min_priority_is_configurable(make: MakeManager) -> None:
    manager = make(num_blocks=2, reserved_blocks=1, reserved_min_priority=10)
    alloc(manager, "a", tokens(0, 4))
    assert alloc(manager, "p9", tokens(10, 1), priority=9) == OpResult(False, [])
    assert alloc(manager, "p10", tokens(10, 1), priority=10).block_ids == [1]


# --- apply(): batches ---------------------------------------------------------------------------


def test_batch_with_a_failing_op_applies_the_others(make: MakeManager) -> None:
    manager = make(num_blocks=4)
    results = run(
        manager,
        AllocateOp("a", tokens(0, 4), 4),
        AllocateOp("big", tokens(100, 16), 16),
        AllocateOp("b", tokens(200, 5), 5),
    )
    assert results == [OpResult(True, [0], 0, 4), OpResult(False, []), OpResult(True, [1, 2], 0, 5)]
    assert not manager.has_sequence("c", "big")


def test_ops_on_a_sequence_whose_creation_failed_fail_too(make: MakeManager) -> None:
    manager = make(num_blocks=3)
    alloc(manager, "keep", [1])
    ops = [
        AllocateOp("big", tokens(0, 9), 9),
        AppendOp("big", [1]),
        ForkOp("big", "child"),
        FreeOp("child"),
        FreeOp("big"),
        AllocateOp("big", tokens(0, 3), 3),  # the id may be used again, and this one fits
        AppendOp("big", [1]),
    ]
    assert [r.ok for r in run(manager, *ops)] == [False, False, False, False, False, True, True]
    assert manager.block_table("c", "big") == [1] and not manager.has_sequence("c", "child")


def test_batch_is_validated_against_its_own_earlier_ops(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 3))  # [0]
    ops = [
        ForkOp("a", "y"),
        AppendOp("a", [3, 4]),
        AllocateOp("x", [9], 1),
        AppendOp("x", [9]),
        FreeOp("a"),
        AppendOp("y", [5]),
        FreeOp("x"),
    ]
    results = run(manager, *ops)
    assert [r.ok for r in results] == [True] * 7
    assert results[1].copies == [(0, 1)] and results[1].block_ids == [2]
    assert manager.block_table("c", "y") == [0]
    assert not manager.has_sequence("c", "a") and not manager.has_sequence("c", "x")


def test_fork_after_append_in_one_batch_shares_the_pending_tokens(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 6))  # [0, 1]
    results = run(manager, AppendOp("a", [6]), ForkOp("a", "b"), FreeOp("a"))
    assert [r.ok for r in results] == [True, True, True]
    # Appending to b now must wait for the next batch, when token 6's K/V is in block 1.
    assert manager.block_table("c", "b") == [0, 1] and run(manager, AppendOp("b", [7])) == [OpResult(True, [])]


def test_blocks_freed_with_pending_tokens_serve_no_later_op_of_the_batch(make: MakeManager) -> None:
    # x's token 9 is written into block 1 after the batch, x freed or not. Found by the state
    # machine: handing block 1 to b's copy-on-write let that write land on top of b's copy.
    copies: list[tuple[int, int]] = []
    manager = make(num_blocks=3, copy_block=lambda src, dst: copies.append((src, dst)))
    alloc(manager, "a", tokens(0, 2))  # [0], 2 tokens
    results = run(manager, AllocateOp("x", [9], 1), ForkOp("a", "b"), FreeOp("x"), AppendOp("b", [7]))
    assert results == [
        OpResult(True, [1], 0, 1),
        OpResult(True, [0]),
        OpResult(True, [1]),
        OpResult(True, [], copies=[(0, 2)]),  # not block 1
    ]
    assert copies == [(0, 2)] and manager.block_table("c", "b") == [2]
    assert refs(manager) == [1, 0, 1]  # block 1 comes back when the batch ends
    assert alloc(manager, "y", [5]).block_ids == [1]


def test_blocks_freed_after_an_append_come_back_after_the_batch(make: MakeManager) -> None:
    manager = make(num_blocks=2)
    alloc(manager, "a", tokens(0, 2))  # [0]
    results = run(manager, AppendOp("a", [2]), FreeOp("a"), AllocateOp("y", [5], 1), AllocateOp("z", [6], 1))
    # Block 0 still awaits token 2's K/V: z finds no block in this batch.
    assert results == [OpResult(True, []), OpResult(True, [0]), OpResult(True, [1], 0, 1), OpResult(False, [])]
    assert refs(manager) == [0, 1] and alloc(manager, "z", [6]).block_ids == [0]


def test_a_failing_copy_block_still_releases_the_blocks_freed_earlier_in_the_batch(make: MakeManager) -> None:
    def broken_copy(src: int, dst: int) -> None:
        raise OSError("device lost")

    manager = make(num_blocks=3, copy_block=broken_copy)
    alloc(manager, "a", tokens(0, 2))  # [0]
    run(manager, ForkOp("a", "b"))
    with pytest.raises(OSError, match="device lost"):
        manager.apply("c", [AllocateOp("x", [9], 1), FreeOp("x"), AppendOp("b", [7])])
    manager.check_integrity()
    assert not manager.has_sequence("c", "x") and refs(manager) == [2, 0, 0]


def test_fork_then_append_in_one_batch(make: MakeManager) -> None:
    # The compute service's parallel sampling: fork the children, then append each one's token.
    copies: list[tuple[int, int]] = []
    manager = make(copy_block=lambda src, dst: copies.append((src, dst)))
    alloc(manager, "a", tokens(0, 6))  # [0, 1]
    results = run(
        manager, ForkOp("a", "b"), ForkOp("a", "c"), AppendOp("a", [6]), AppendOp("b", [7]), AppendOp("c", [8])
    )
    assert [r.copies for r in results] == [[], [], [(1, 2)], [(1, 3)], []]
    assert copies == [(1, 2), (1, 3)]
    assert [manager.block_table("c", s) for s in "abc"] == [[0, 2], [0, 3], [0, 1]]


BAD_BATCHES = [
    ([AppendOp("nope", [1])], "nope"),
    ([FreeOp("nope")], "nope"),
    ([ForkOp("ghost", "child")], "ghost"),
    ([ForkOp("keep", "keep")], "already"),
    ([AllocateOp("keep", [1], 1)], "already"),
    ([AllocateOp("x", [1], 1), AllocateOp("x", [2], 1)], "already"),
    ([FreeOp("keep"), AppendOp("keep", [1])], "freed"),
    # Another client's sequence: to this client it is simply not live (ids are per client).
    ([AppendOp("other", [1])], "'other' is not a live sequence of this client"),
    ([FreeOp("other")], "'other' is not a live sequence of this client"),
    ([ForkOp("other", "mine")], "'other' is not a live sequence of this client"),
    ([AllocateOp("x", [1], 1, namespace="n" * 1025)], "namespace has 1025 characters"),
    ([AllocateOp("x", [], 1)], "empty"),
    ([AllocateOp("x", [1, -1], 1)], "token"),
    ([AllocateOp("x", [1, 2**32], 1)], "token"),
    ([AllocateOp("x", [1.5], 1)], "int"),
    ([AllocateOp("x", "abc", 1)], "int"),
    ([AllocateOp("x", b"abcd", 1)], "int"),
    ([AllocateOp("x", [1], 0)], "max_num_new_tokens"),
    ([AllocateOp("x", [1], -5)], "max_num_new_tokens"),
    ([AllocateOp("x", [1], 1, priority=1.0)], "priority"),
    ([AllocateOp("x", [1], 1, namespace=None)], "namespace"),
    ([AllocateOp("x", [1] * 33, 1)], "32"),  # 8 blocks of 4 hold 32 tokens
    ([AppendOp("keep", [1] * 29)], "32"),  # keep holds 4
    ([AllocateOp("x", [1] * 20, 20), AppendOp("x", [1] * 13)], "33"),
    ([AppendOp("keep", [1]), ForkOp("keep", "k2"), AppendOp("k2", [2])], "not written yet"),
    ([AppendOp("keep", [1]), ForkOp("keep", "k2"), AppendOp("keep", [2])], "not written yet"),
    ([AllocateOp("x", [1], 1), ForkOp("x", "y"), ForkOp("y", "z"), AppendOp("z", [2])], "not written yet"),
    ([AppendOp("keep", [])], "empty"),
    ([AllocateOp("", [1], 1)], "seq_id"),
    ([AllocateOp(7, [1], 1)], "seq_id"),
    (["free keep"], "expected an AllocateOp"),
]


@pytest.mark.parametrize(("bad_ops", "needle"), BAD_BATCHES)
def test_bad_batches_raise_and_change_nothing(make: MakeManager, bad_ops: list, needle: str) -> None:
    manager = make()
    manager.add_client("other-client")
    manager.apply("other-client", [AllocateOp("other", [9], 1)])
    alloc(manager, "keep", tokens(0, 4))
    before = snapshot(manager)
    # A valid op in front of the bad one must not be applied either.
    with pytest.raises(ValueError, match=needle):
        manager.apply("c", [AllocateOp("a", tokens(100, 6), 6), *bad_ops])
    assert snapshot(manager) == before
    assert not manager.has_sequence("c", "a")


def test_unknown_client_raises(make: MakeManager) -> None:
    manager = make()
    with pytest.raises(ValueError, match="who"):
        manager.apply("who", [])
    with pytest.raises(ValueError, match="who"):
        manager.release_client("who")


def test_single_op_methods(make: MakeManager) -> None:
    manager = make()
    assert manager.allocate("c", AllocateOp("a", tokens(0, 6), 6)) == OpResult(True, [0, 1], 0, 6)
    assert manager.fork("c", ForkOp("a", "b")) == OpResult(True, [0, 1])
    assert manager.append("c", AppendOp("b", [6])) == OpResult(True, [], copies=[(1, 2)])
    assert manager.free("c", FreeOp("a")) == OpResult(True, [0, 1])
    with pytest.raises(ValueError, match="expected an AllocateOp, got FreeOp"):
        manager.allocate("c", FreeOp("b"))
    with pytest.raises(ValueError, match="not a live sequence"):
        manager.append("c", AppendOp("a", [1]))


def test_block_table_is_a_copy_and_checks_its_argument(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 5))
    manager.block_table("c", "a").append(99)
    assert manager.block_table("c", "a") == [0, 1]
    with pytest.raises(ValueError, match="zzz"):
        manager.block_table("c", "zzz")
    with pytest.raises(ValueError, match="block_id"):
        manager.ref_count(8)


# --- clients ------------------------------------------------------------------------------------


def test_sequence_ids_are_per_client_and_reveal_nothing(make: MakeManager) -> None:
    """Another client's sequence reads exactly like an absent one."""
    manager = make()
    manager.add_client("d")
    [theirs] = manager.apply("d", [AllocateOp("s", tokens(100, 4), 4)])
    with pytest.raises(ValueError) as not_yours:
        manager.apply("c", [FreeOp("s")])
    with pytest.raises(ValueError) as absent:
        manager.apply("c", [FreeOp("t")])
    assert str(not_yours.value).replace("'s'", "'t'") == str(absent.value)
    with pytest.raises(ValueError, match="not a live sequence of this client"):
        manager.block_table("c", "s")
    # The same id is free for this client, and names its own sequence from then on.
    [mine] = run(manager, AllocateOp("s", tokens(200, 4), 4))
    assert manager.block_table("c", "s") == mine.block_ids != theirs.block_ids == manager.block_table("d", "s")
    run(manager, FreeOp("s"))
    assert manager.block_table("d", "s") == theirs.block_ids


def test_release_client_frees_its_sequences_and_keeps_the_cache(make: MakeManager) -> None:
    manager = make()
    manager.add_client("d")
    alloc(manager, "a", tokens(0, 9))  # [0, 1, 2]
    run(manager, ForkOp("a", "a2"))
    manager.apply("d", [AllocateOp("other", tokens(100, 4), 4)])  # [3]
    assert manager.release_client("c") == 2
    assert not manager.has_client("c") and manager.has_client("d")
    assert not manager.has_sequence("c", "a") and not manager.has_sequence("c", "a2")
    assert manager.has_sequence("d", "other")
    assert manager.stats().general == PoolStats("general", 8, 5, 2, 1)
    [hit] = manager.apply("d", [AllocateOp("again", tokens(0, 9), 9)])
    assert hit.num_cached_tokens == 8
    with pytest.raises(ValueError, match="not attached"):
        manager.apply("c", [])


def test_add_client_checks_its_argument(make: MakeManager) -> None:
    manager = make()
    with pytest.raises(ValueError, match="already attached"):
        manager.add_client("c")
    with pytest.raises(ValueError, match="client_id"):
        manager.add_client("")


# --- stats --------------------------------------------------------------------------------------


def test_stats_of_an_empty_manager(make: MakeManager) -> None:
    stats = make(num_blocks=8, reserved_blocks=3).stats()
    assert stats.pools == (PoolStats("general", 5, 5, 0, 0), PoolStats("reserved", 3, 3, 0, 0))
    assert (stats.kv_utilization, stats.fragmentation, stats.num_sequences) == (0.0, 0.0, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_hit_rate) == (0, 0, 0.0)


def test_utilization_and_fragmentation_count_shared_blocks_once(make: MakeManager) -> None:
    manager = make()
    alloc(manager, "a", tokens(0, 5))  # [0, 1]: 4 + 1 tokens
    alloc(manager, "b", tokens(100, 4))  # [2]: 4 tokens
    stats = manager.stats()
    assert (stats.kv_utilization, stats.fragmentation) == (9 / 12, 3 / 12)
    run(manager, ForkOp("a", "a2"))  # shares both blocks: nothing new stored
    assert manager.stats().kv_utilization == 9 / 12
    run(manager, AppendOp("a2", [5, 6]))  # copy of block 1 holding 3 tokens
    stats = manager.stats()
    assert (stats.kv_utilization, stats.fragmentation, stats.num_sequences) == (12 / 16, 4 / 16, 3)
    assert stats.general == PoolStats("general", 8, 4, 0, 4)


def test_cache_namespace_is_unambiguous_and_bounded(make: MakeManager) -> None:
    """Distinct (model, salt) pairs never share a namespace (``model|salt`` once was ambiguous), and
    a long salt is hashed, not kept in full."""
    from memory_service.api import cache_namespace
    from memory_service.manager.prefix_cache import NAMESPACE_KEY_SIZE

    assert cache_namespace("m|a", "b") != cache_namespace("m", "a|b")
    assert cache_namespace("m", "") != cache_namespace("m", "x") == cache_namespace("m", "x")
    huge = cache_namespace("model", "s" * (8 << 20))
    assert len(huge) < 64
    manager = make()
    run(manager, AllocateOp("a", tokens(0, 9), 9, namespace=huge))
    keys = [key for key in manager._prefix_cache.block_keys if key is not None]
    assert len(keys) == 2 and all(len(key[2]) == NAMESPACE_KEY_SIZE for key in keys)


# --- per-client quotas ---------------------------------------------------


def test_quota_refuses_beyond_n_block_table_entries(make: MakeManager) -> None:
    """A client capped at 3 entries: an allocation or append past 3 fails as out of blocks and
    changes nothing, though the pool has 16; a fork is counted, never refused; a free gives its
    entries back. Before: no quota, one client could hold every block."""
    manager = make(num_blocks=16)
    manager.add_client("q", max_blocks=3)

    def q(*ops: object) -> list[OpResult]:
        return run(manager, *ops, client="q")

    assert q(AllocateOp("a", tokens(0, 8), 1000))[0].block_ids == [0, 1]
    assert manager.num_quota_left("q") == 1
    assert q(AllocateOp("b", tokens(100, 5), 1000)) == [OpResult(False, [])]  # would be 2 more: 4 > 3
    assert q(AppendOp("a", [8, 9, 10, 11])) == [OpResult(True, [2])]  # the third entry
    assert q(AppendOp("a", [12])) == [OpResult(False, [])]
    assert manager.num_quota_left("q") == 0 and manager.num_available_blocks() == (13, 0)
    assert q(ForkOp("a", "f")) == [OpResult(True, [0, 1, 2])]  # counted: 6 entries, still 3 blocks
    assert manager.num_quota_left("q") == -3
    assert q(AllocateOp("c", tokens(200, 1), 1000)) == [OpResult(False, [])]
    q(FreeOp("f"), FreeOp("a"))
    assert manager.num_quota_left("q") == 3
    assert q(AllocateOp("c", tokens(200, 12), 1000))[0].block_ids == [3, 4, 5]  # 3 new blocks: at the cap
    # The unquoted client "c" is not limited by "q"'s quota.
    assert len(alloc(manager, "big", tokens(500, 40)).block_ids) == 10
    manager.release_client("q")
    assert manager.stats().pools[0].num_used_blocks == 10
