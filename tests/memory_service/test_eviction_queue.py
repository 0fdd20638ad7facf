"""EvictionQueue against an OrderedDict model: same eviction order, same length, bounded memory."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from memory_service.manager.eviction_queue import EvictionQueue

pytestmark = pytest.mark.unit


def test_pops_least_recently_joined_first_and_skips_removed_blocks() -> None:
    lru = EvictionQueue()
    for block_id in (5, 3, 9, 1):
        lru.append(block_id)
    lru.remove(3)  # shared again: its entry turns stale
    lru.append(3)  # freed again: now the most recent
    lru.remove(9)
    assert len(lru) == 3 and list(lru) == [5, 1, 3]
    assert lru.pop_oldest(2) == [5, 1]
    lru.check_integrity()
    assert lru.pop_oldest(1) == [3] and len(lru) == 0
    lru.check_integrity()


def test_popping_more_than_it_holds_is_a_bug() -> None:
    lru = EvictionQueue()
    lru.append(1)
    lru.remove(1)
    with pytest.raises((AssertionError, IndexError)):
        lru.pop_oldest(1)


@pytest.mark.parametrize("seed", range(6))
def test_matches_an_ordered_dict_under_random_use(seed: int) -> None:
    rng = random.Random(seed)
    lru, model = EvictionQueue(min_compact_length=8), OrderedDict[int, None]()
    outside = list(range(64))  # blocks not in the LRU
    for _ in range(4000):
        action = rng.random()
        if action < 0.45 and outside:  # a block becomes evictable
            block_id = outside.pop(rng.randrange(len(outside)))
            lru.append(block_id)
            model[block_id] = None
        elif action < 0.75 and model:  # a cached block is shared again
            block_id = rng.choice(list(model))
            lru.remove(block_id)
            del model[block_id]
            outside.append(block_id)
        elif model:  # eviction
            num = rng.randint(1, len(model))
            expected = [model.popitem(last=False)[0] for _ in range(num)]
            assert lru.pop_oldest(num) == expected
            outside += expected
        assert len(lru) == len(model) and list(lru) == list(model)
        lru.check_integrity()
        # Consumed and stale entries are dropped as they pile up: live + stale <= 64 + 64 entries
        # past the head, and the consumed head is at most as long (or under the threshold, 8).
        assert len(lru._ids) <= 2 * (2 * 64 + 8), len(lru._ids)
