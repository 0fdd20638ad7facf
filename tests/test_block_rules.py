"""The block rules that both sides of the memory service's wire apply, each stated once: how many
blocks hold n tokens (sampling_rules.num_blocks_for) and who may take reserved blocks (ReservedPool)."""

from __future__ import annotations

import pytest

from compute_service.engine.config import EngineConfig
from compute_service.engine.scheduler import Scheduler
from memory_service.api import AllocateOp, KvLayout, ReservedPool
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig
from pagedserve.sampling_rules import kv_blocks_needed, num_blocks_for

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("num_tokens", "block_size", "num_blocks"), [
    (0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2), (1, 1, 1), (1000, 7, 143)])
def test_num_blocks_for_is_ceil_division(num_tokens: int, block_size: int, num_blocks: int) -> None:
    assert num_blocks_for(num_tokens, block_size) == num_blocks


def test_a_request_costs_its_shared_full_blocks_and_n_tails() -> None:
    # 10 prompt tokens in blocks of 4: 2 full blocks shared; each of 3 completions owns the partial
    # third block's copy and room for 5 more tokens: ceil((2 + 5) / 4) = 2 blocks.
    assert kv_blocks_needed(10, 5, 3, 4) == 2 + 3 * 2


def test_reserved_pool_admits_from_its_min_priority() -> None:
    reserved = ReservedPool(num_blocks=4, min_priority=2)
    assert [reserved.admits(p) for p in (0, 1, 2, 9)] == [False, False, True, True]
    assert reserved.num_available_for(1, num_general=3, num_reserved=4) == 3
    assert reserved.num_available_for(2, num_general=3, num_reserved=4) == 7
    assert BlockManagerConfig(num_blocks=8, reserved_blocks=4, reserved_min_priority=2).reserved_pool == reserved


def test_scheduler_and_block_manager_apply_the_same_rule() -> None:
    """One ReservedPool on both sides: the scheduler plans with the allocator's, and a sequence the
    scheduler thinks cannot have reserved blocks is refused them by the manager too."""
    layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_size=4)
    allocator = InProcessAllocator(layout, BlockManagerConfig(num_blocks=8, block_size=4, reserved_blocks=6,
                                                              reserved_min_priority=2))
    scheduler = Scheduler(EngineConfig(block_size=4), 4, allocator.num_blocks, allocator.reserved)
    assert scheduler.reserved is allocator.reserved
    assert (scheduler.num_general_blocks, scheduler.num_available_blocks, scheduler.num_available_reserved_blocks) \
        == (2, 2, 6)
    for priority, ok in ((1, False), (2, True)):  # 12 tokens: 3 blocks, more than the 2 general ones
        assert (scheduler._available_for(priority) >= 3) is ok
        [result] = allocator.step([AllocateOp(f"p{priority}", [5] * 12, 12, priority)])
        assert result.ok is ok
    assert allocator.check_integrity() is None
