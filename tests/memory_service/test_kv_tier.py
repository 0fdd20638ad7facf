"""The block manager over a disk tier, in process: write-behind, loads answered ``loading``, the
bytes that come back, namespaces, untrusted clients, one load per sequence, load or recompute."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from memory_service.api import AllocateOp, FreeOp, KvLayout
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig

pytestmark = pytest.mark.unit

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks and one token
_others = iter(range(1000, 10**6, 100))


def other_prompt() -> list[int]:
    """32 tokens never seen before: 8 full blocks, the whole pool."""
    start = next(_others)
    return list(range(start, start + 32))


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def allocator(tmp_path: Path):
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=8, block_size=4),
                               kv_disk_dir=tmp_path / "tier", model_fingerprint="model-a")
    yield alloc
    assert alloc.check_integrity() is None
    alloc.close()


def write_prompt_and_evict(alloc: InProcessAllocator, namespace: str = "ns") -> None:
    """PROMPT's blocks, each filled with its position + 1, written out, then evicted."""
    [result] = alloc.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace=namespace)])
    assert result.ok and result.num_cached_tokens == 0
    for position, block_id in enumerate(result.block_ids):
        alloc.pool[:, :, block_id] = float(position + 1)
    alloc.step([FreeOp("s1")])  # commits the K/V written above: 3 full blocks, queued for the disk
    wait_for(lambda: alloc.stats().tiers[0].num_blocks == 3)
    evict(alloc, "s2")


def evict(alloc: InProcessAllocator, seq_id: str) -> None:
    """A new prompt takes every block of the pool: every cached block is evicted."""
    [result] = alloc.step([AllocateOp(seq_id, other_prompt(), 32, namespace="other")])
    assert result.ok
    alloc.step([FreeOp(seq_id)])
    alloc.pool.zero_()  # whatever comes back comes from the disk


def load(alloc: InProcessAllocator, seq_id: str, namespace: str = "ns", prefill_tokens_per_s: float = 0.0):
    """Allocates PROMPT; while it answers ``loading``, steps until the load is reported, then retries."""
    op = AllocateOp(seq_id, PROMPT, len(PROMPT), namespace=namespace)
    reply = alloc.step_with_counts([op], prefill_tokens_per_s)
    if not reply.results[0].loading:
        return reply.results[0], False
    assert not reply.results[0].ok and reply.results[0].block_ids == []
    reported: list[str] = list(reply.loaded_seq_ids)
    while seq_id not in reported:
        time.sleep(0.01)
        reported += alloc.step_with_counts([]).loaded_seq_ids
    [result] = alloc.step([op])
    return result, True


def test_evicted_blocks_come_back_from_the_disk_as_cached_tokens(allocator: InProcessAllocator) -> None:
    write_prompt_and_evict(allocator)
    result, loaded = load(allocator, "s3")
    assert loaded and result.ok and result.num_cached_tokens == 12
    for position, block_id in enumerate(result.block_ids[:3]):
        assert (allocator.pool[:, :, block_id] == float(position + 1)).all()
    tier = allocator.stats().tiers[0]
    assert (tier.num_hits, tier.num_loads, tier.num_bytes_read > 0) == (3, 1, True)
    assert allocator.stats().prefix_cache_hits == 12


def test_namespaces_stay_apart(allocator: InProcessAllocator) -> None:
    write_prompt_and_evict(allocator, namespace="tenant-a")
    result, loaded = load(allocator, "s3", namespace="tenant-b")
    assert not loaded and result.ok and result.num_cached_tokens == 0


def test_one_load_per_sequence(allocator: InProcessAllocator) -> None:
    write_prompt_and_evict(allocator)
    op = AllocateOp("s3", PROMPT, len(PROMPT), namespace="ns")
    assert allocator.step([op])[0].loading
    wait_for(lambda: "s3" in allocator.step_with_counts([]).loaded_seq_ids)
    evict(allocator, "s4")  # the loaded blocks are evicted before the retry
    [result] = allocator.step([op])  # its load is over: recomputed, not loaded again
    assert result.ok and not result.loading and result.num_cached_tokens == 0


def test_recompute_when_it_is_estimated_faster(allocator: InProcessAllocator) -> None:
    write_prompt_and_evict(allocator)
    assert load(allocator, "s3")[1]  # measures the read bandwidth
    allocator.step([FreeOp("s3")])
    evict(allocator, "s5")
    result, loaded = load(allocator, "s4", prefill_tokens_per_s=1e15)  # an absurdly fast prefill
    assert not loaded and result.ok and result.num_cached_tokens == 0
    assert allocator.stats().tiers[0].num_loads_skipped == 1


def test_blocks_of_a_client_without_a_tier_identity_are_never_persisted(allocator: InProcessAllocator) -> None:
    manager = allocator.block_manager
    manager.add_client("guest")  # no tier identity: as an untrusted client of the service
    [result] = manager.apply("guest", [AllocateOp("g1", PROMPT, len(PROMPT), namespace="ns")])
    manager.apply("guest", [FreeOp("g1")])  # committed and cached
    assert manager.take_tier_writes(100) == []
    [result] = allocator.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace="ns")])  # shares them
    assert result.num_cached_tokens == 12
    assert manager.take_tier_writes(100) == []  # shared, not re-registered: still not the tier's
    manager.release_client("guest")
