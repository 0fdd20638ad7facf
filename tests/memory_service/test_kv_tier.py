"""The block manager over a disk tier, in process: write-behind, loads answered ``loading``, the
bytes that come back, namespaces, untrusted clients, one load per sequence, load or recompute."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.errors import InvalidArgument
from memory_service.api import AllocateOp, FreeOp, KvLayout, OpResult
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig
from memory_service.tier import worker

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


def test_a_load_stops_at_a_block_file_that_went(allocator: InProcessAllocator, tmp_path: Path) -> None:
    """Files are read ahead in parallel; a missing one still ends the load there: the blocks before
    it come back, the ones after it are recomputed (never loaded past a gap)."""
    write_prompt_and_evict(allocator)
    written = list(allocator.tier.tiers["disk"]._index)  # PROMPT's keys, in the order written: block order
    assert len(written) == 3
    (tmp_path / "tier" / f"{written[1].hex()}.kv").unlink()  # the middle block's
    result, loaded = load(allocator, "s3")
    assert loaded and result.ok and result.num_cached_tokens == 4
    assert (allocator.pool[:, :, result.block_ids[0]] == 1.0).all()
    assert allocator.stats().tiers[0].num_loads == 1


def test_a_stalled_read_ends_its_load_at_the_deadline_and_holds_no_other_load(
        allocator: InProcessAllocator, monkeypatch: pytest.MonkeyPatch) -> None:
    """One loader thread and no deadline held a prompt, and every later disk load, for good behind a
    file read that never came back (a FIFO planted under a block's name, before ``open_own_file``).
    The first file read of the first load stalls here as a hung device's would (a regular file whose
    read never returns cannot be made in a test): that load ends at its deadline, a recompute (no
    cached tokens); a second prompt's load, submitted after it, is not held behind it."""
    monkeypatch.setattr(worker, "LOAD_DEADLINE_S", 3.0)
    second = list(range(300, 313))
    [first, other] = allocator.step([AllocateOp("w1", PROMPT, len(PROMPT), namespace="ns"),
                                     AllocateOp("w2", second, len(second), namespace="ns")])
    for result in (first, other):
        for position, block_id in enumerate(result.block_ids):
            allocator.pool[:, :, block_id] = float(position + 1)
    allocator.step([FreeOp("w1"), FreeOp("w2")])
    wait_for(lambda: allocator.stats().tiers[0].num_blocks == 6)
    evict(allocator, "hog")
    disk, stall, calls = allocator.tier.tiers["disk"], threading.Event(), iter(range(10**6))
    read = disk.get

    def stalled_get(key: bytes, ns_key: bytes):
        if next(calls) == 0:
            stall.wait()
        return read(key, ns_key)

    monkeypatch.setattr(disk, "get", stalled_get)
    try:
        start = time.monotonic()
        slow_op, fast_op = (AllocateOp("s3", PROMPT, len(PROMPT), namespace="ns"),
                            AllocateOp("s4", second, len(second), namespace="ns"))
        assert allocator.step([slow_op])[0].loading
        assert allocator.step([fast_op])[0].loading
        reported: list[str] = []
        wait_for(lambda: "s4" in reported or bool(reported.extend(allocator.step_with_counts([]).loaded_seq_ids)))
        assert "s3" not in reported  # the fast load came back while the stalled one waits for its deadline
        [fast] = allocator.step([fast_op])
        assert fast.ok and fast.num_cached_tokens == 12
        wait_for(lambda: "s3" in reported or bool(reported.extend(allocator.step_with_counts([]).loaded_seq_ids)))
        assert 3.0 <= time.monotonic() - start < 10.0
        [slow] = allocator.step([slow_op])
        assert slow.ok and not slow.loading and slow.num_cached_tokens == 0
    finally:
        stall.set()


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


def tier_counters(alloc: InProcessAllocator) -> tuple[int, int, int, int]:
    """(hits, misses, loads, loads skipped) of the tier."""
    tier = alloc.stats().tiers[0]
    return tier.num_hits, tier.num_misses, tier.num_loads, tier.num_loads_skipped


LONG_PROMPT = list(range(200, 241))  # 41 tokens: 10 full blocks and one token


def test_an_allocation_counts_its_tier_lookup_once_however_often_it_is_retried(tmp_path: Path) -> None:
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=12, block_size=4),
                               kv_disk_dir=tmp_path / "tier", model_fingerprint="model-a")
    hogs = iter(range(10_000, 10**6, 100))

    def hog() -> None:
        """A prompt never seen takes the whole pool (12 blocks): every cached block is evicted."""
        start = next(hogs)
        assert alloc.step([AllocateOp("hog", list(range(start, start + 48)), 48, namespace="other")])[0].ok

    def counted_since(base: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(now - then for now, then in zip(tier_counters(alloc), base))

    try:
        assert alloc.step([AllocateOp("s1", LONG_PROMPT, 41, namespace="ns")])[0].ok
        alloc.step([FreeOp("s1")])
        wait_for(lambda: alloc.stats().tiers[0].num_blocks == 10)
        hog()
        base = tier_counters(alloc)
        op = AllocateOp("s2", LONG_PROMPT, 41, namespace="ns")
        for _ in range(3):  # no room to load into, nor to allocate: retried, looked up each time
            [result] = alloc.step([op])
            assert not result.ok and not result.loading
        assert counted_since(base) == (0, 0, 0, 0)  # nothing counted before the allocation ends
        alloc.step([FreeOp("hog")])
        assert alloc.step([op])[0].loading
        alloc.step([op])  # retried at once: waiting, or (load over) allocated
        wait_for(lambda: alloc.block_manager.has_sequence(alloc.client_id, "s2")
                 or "s2" in alloc.step_with_counts([]).loaded_seq_ids)
        if not alloc.block_manager.has_sequence(alloc.client_id, "s2"):
            [result] = alloc.step([op])
            assert result.ok and result.num_cached_tokens == 40
        assert counted_since(base) == (10, 0, 1, 0)  # the 10 blocks it loaded, once
        # A prompt the tier lacks: one miss, however often its allocation is retried.
        alloc.step([FreeOp("s2")])
        hog()
        base = tier_counters(alloc)
        fresh = AllocateOp("s3", list(range(7000, 7041)), 41, namespace="ns")
        for _ in range(3):
            assert not alloc.step([fresh])[0].ok
        alloc.step([FreeOp("hog")])
        assert alloc.step([fresh])[0].ok
        assert counted_since(base) == (0, 1, 0, 0)
        # A load recompute beats: one skipped load (and its blocks' hits), however often retried.
        alloc.step([FreeOp("s3")])
        hog()  # LONG_PROMPT's blocks leave the pool again
        base = tier_counters(alloc)
        op = AllocateOp("s4", LONG_PROMPT, 41, namespace="ns")
        for _ in range(3):
            assert not alloc.step_with_counts([op], prefill_tokens_per_s=1e15).results[0].ok
        alloc.step([FreeOp("hog")])
        [result] = alloc.step_with_counts([op], prefill_tokens_per_s=1e15).results
        assert result.ok and result.num_cached_tokens == 0
        assert counted_since(base) == (10, 0, 0, 1)
        assert alloc.check_integrity() is None
    finally:
        alloc.close()


def test_a_load_takes_no_blocks_beyond_the_clients_quota(tmp_path: Path) -> None:
    # Quota 8 of a 16-block pool. PROMPT_25 has 6 full blocks (+1 token): 7 blocks allocated whole.
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=16, block_size=4),
                               kv_disk_dir=tmp_path / "tier", model_fingerprint="model-a", max_blocks=8)
    prompt = list(range(300, 325))
    manager = alloc.block_manager
    try:
        assert alloc.step([AllocateOp("s1", prompt, 25, namespace="ns")])[0].ok
        alloc.step([FreeOp("s1")])
        wait_for(lambda: alloc.stats().tiers[0].num_blocks == 6)
        for seq_id in ("e1", "e2"):  # 8 blocks each: the prompt's 6 are evicted from the pool
            assert alloc.step([AllocateOp(seq_id, other_prompt(), 32, namespace="other")])[0].ok
            alloc.step([FreeOp(seq_id)])
        assert alloc.step([AllocateOp("held", list(range(900, 920)), 20, namespace="other")])[0].ok
        assert manager.num_quota_left(alloc.client_id) == 3  # 5 entries held
        # The whole prompt at once needs 7 entries: no load (it alone would pin 6), no allocation.
        [result] = alloc.step([AllocateOp("s2", prompt, 25, namespace="ns")])
        assert not result.ok and not result.loading and tier_counters(alloc)[2] == 0
        # A 4-token chunk: 1 new block, so 2 loaded blocks fit beside it (the retry's table: 3).
        op = AllocateOp("s3", prompt, 4, namespace="ns")
        with alloc._lock:  # (the writer thread's calls wait) the load starts; the next step submits it
            [result] = manager.apply(alloc.client_id, [op])
            assert result.loading and manager.num_quota_left(alloc.client_id) == 1  # it pins 2 blocks
        reported = list(alloc.step_with_counts([]).loaded_seq_ids)
        while "s3" not in reported:
            time.sleep(0.01)
            reported += alloc.step_with_counts([]).loaded_seq_ids
        [result] = alloc.step([op])
        assert result.ok and (result.num_cached_tokens, result.num_new_tokens, len(result.block_ids)) == (8, 4, 3)
        assert manager.num_quota_left(alloc.client_id) == 0
        # Found 6 blocks, loaded the 2 the quota left room for; the 4 prompts before (s1, e1, e2,
        # held) missed, s2 (never allocated) is not counted.
        assert tier_counters(alloc) == (6, 4, 1, 0)
        assert alloc.check_integrity() is None
    finally:
        alloc.close()


def test_parked_sequences_their_client_frees_leave_nothing_in_the_tier_book(allocator: InProcessAllocator) -> None:
    """A request aborted while parked on a load: its client frees the sequence (it holds no blocks),
    and the book forgets it, whether its load was over (reported, never retried), still running, or
    started in the same batch. Without it each one stayed in ``loaded`` until the client detached."""
    manager = allocator.block_manager
    book, client = manager._tier, allocator.client_id
    write_prompt_and_evict(allocator)
    reported: list[str] = []

    def op(seq_id: str) -> AllocateOp:
        return AllocateOp(seq_id, PROMPT, len(PROMPT), namespace="ns")

    def wait_for_loads() -> None:
        wait_for(lambda: not reported.extend(allocator.step_with_counts([]).loaded_seq_ids) and not book.loads)

    for n in range(3):
        # Its load over and reported, never retried: then freed.
        assert allocator.step([op(f"over{n}")])[0].loading
        wait_for(lambda seq_id=f"over{n}": seq_id in allocator.step_with_counts([]).loaded_seq_ids)
        assert book.loaded[client] == {f"over{n}"}
        assert allocator.step([FreeOp(f"over{n}")]) == [OpResult(True, [])]
        evict(allocator, f"e{n}")
        # Freed while its load runs (not even handed to the loader yet): it ends unreported.
        with allocator._lock:
            assert manager.apply(client, [op(f"running{n}")])[0].loading
            assert manager.apply(client, [FreeOp(f"running{n}")]) == [OpResult(True, [])]
        wait_for_loads()
        evict(allocator, f"f{n}")
        # Freed in the batch that started its load: it failed like its AllocateOp, and is forgotten.
        results = allocator.step([op(f"batch{n}"), FreeOp(f"batch{n}")])
        assert results[0].loading and not results[1].ok
        wait_for_loads()
        evict(allocator, f"g{n}")
    assert reported == []
    assert (book.loaded, book.reports, book.loads, book.new_loads, book.num_pinned) == (
        {client: set()}, {client: []}, {}, [], {client: 0})
    # Forgotten for good: a second FreeOp is a bad op, and the id may load again.
    with pytest.raises(InvalidArgument, match="over0"):
        allocator.step([FreeOp("over0")])
    assert allocator.step([op("over0")])[0].loading
    wait_for(lambda: "over0" in allocator.step_with_counts([]).loaded_seq_ids)
    [result] = allocator.step([op("over0")])
    assert result.ok and result.num_cached_tokens == 12
    assert (book.loaded, book.reports) == ({client: set()}, {client: []})


def test_close_writes_the_committed_blocks_not_on_disk_yet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean stop right after a commit: the writer had copied (staged) the blocks, not written them;
    ``close`` writes them all before it returns, so a new tier on the directory finds every one. (Its
    deadline raised: on a loaded machine 2 s of file writes were not always enough; ``close`` returns
    once everything is written, not at the deadline.)"""
    monkeypatch.setattr(worker, "CLOSE_WRITE_S", 60.0)
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=72, block_size=4),
                               kv_disk_dir=tmp_path / "tier", model_fingerprint="model-a")
    prompt = list(range(2000, 2000 + 64 * 4 + 1))  # 64 full blocks and one token
    [result] = alloc.step([AllocateOp("s1", prompt, len(prompt), namespace="ns")])
    assert result.ok
    alloc.step([FreeOp("s1")])  # commits 64 full blocks: queued for the disk
    alloc.close()
    assert len([p for p in (tmp_path / "tier").iterdir() if p.suffix == ".kv"]) == 64
    again = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=72, block_size=4),
                               kv_disk_dir=tmp_path / "tier", model_fingerprint="model-a")
    try:
        assert again.stats().tiers[0].num_blocks == 64
    finally:
        again.close()


def test_the_writer_thread_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    """The write-behind must not slow the engine: its thread runs at SCHED_IDLE (``WRITER_NICE``'s
    comment), the loader's not (a parked request waits for it)."""
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=16, block_size=4),
                               kv_disk_dir=tmp_path / "tier", model_fingerprint="model-a")
    try:
        [result] = alloc.step([AllocateOp("s1", list(range(9)), 9, namespace="ns")])
        assert result.ok
        threads = {t.name: t for t in threading.enumerate()}
        writer, loader = threads["kv-tier-writer"], threads["kv-tier-loader-0"]
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(writer.native_id) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.01)  # it sets its own policy as it starts
        assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(loader.native_id) == os.sched_getscheduler(0) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, loader.native_id) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        alloc.close()
