"""The host-RAM tier (``--kv-host-bytes``): its buffer and LRU, and the block manager over it in
process, alone and in front of the disk tier: evicted blocks come back as cached tokens, host
evictions still on disk, a restart finds the disk, tenants apart, foreign blocks never kept, per-tier
counters, bad values refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memory_service.api import AllocateOp, FreeOp
from memory_service.config import MemoryServiceConfig
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig
from memory_service.manager.chain import chain_hashes, root_hash
from memory_service.tier.block_file import TierIdentity
from memory_service.tier import worker
from memory_service.tier.host_tier import HostTier
from tests.memory_service.test_kv_tier import LAYOUT, PROMPT, load, other_prompt, wait_for

pytestmark = pytest.mark.unit

IDENTITY = TierIdentity("model-a", "float32", 4, 2, 2, 4)  # LAYOUT's: 512 bytes a block
BLOCK_BYTES = IDENTITY.bytes_per_block
NS = bytes(range(16))
KEYS = chain_hashes(root_hash(IDENTITY.digest, NS), bytes(range(96)), 16, 6)


def block(value: float) -> torch.Tensor:
    return torch.full(IDENTITY.block_shape, value)


def open_host(num_blocks: int) -> HostTier:
    host = HostTier(num_blocks * BLOCK_BYTES + BLOCK_BYTES // 2)  # a part block's bytes hold nothing
    assert host.open(IDENTITY, pin_memory=False) == num_blocks
    return host


def test_lru_within_the_byte_budget() -> None:
    host = open_host(3)
    for i in range(3):
        assert host.put(KEYS[i], NS, block(i))
    slot, view = host.acquire(KEYS[0], NS)  # a read makes KEYS[0] the youngest
    assert (view == 0.0).all()
    host.release(slot, is_read=True)
    assert host.put(KEYS[3], NS, block(3))  # evicts the least recently used: KEYS[1]
    assert host.keys() == [KEYS[2], KEYS[0], KEYS[3]]
    assert host.put(KEYS[2], NS, block(99))  # held already: only made young, not copied again
    assert host.keys() == [KEYS[0], KEYS[3], KEYS[2]]
    slot, view = host.acquire(KEYS[2], NS)
    assert (view == 2.0).all()
    host.release(slot, is_read=True)
    assert [key in host for key in KEYS[:4]] == [True, False, True, True]
    c = host.counters()
    assert (c.num_blocks, c.num_bytes, c.num_bytes_written, c.num_bytes_read, c.num_write_errors) == (
        3, 3 * BLOCK_BYTES, 4 * BLOCK_BYTES, 2 * BLOCK_BYTES, 0)


def test_a_block_a_load_reads_is_never_overwritten() -> None:
    host = open_host(2)
    assert host.put(KEYS[0], NS, block(0)) and host.put(KEYS[1], NS, block(1))
    slot0, view0 = host.acquire(KEYS[0], NS)
    slot1, _ = host.acquire(KEYS[1], NS)
    assert not host.put(KEYS[2], NS, block(2))  # every slot held by a load: dropped
    host.release(slot1, is_read=True)
    assert host.put(KEYS[2], NS, block(2))  # takes KEYS[1]'s slot, not the held one
    assert (view0 == 0.0).all() and host.keys() == [KEYS[0], KEYS[2]]
    host.release(slot0, is_read=True)
    assert host.counters().num_write_errors == 1  # a put dropped: no slot free of loads


def test_namespace_is_checked_and_a_budget_under_one_block_holds_nothing() -> None:
    host = open_host(2)
    assert host.put(KEYS[0], NS, block(0))
    assert host.acquire(KEYS[0], bytes(16)) is None  # another namespace's key: a miss
    tiny = HostTier(BLOCK_BYTES - 1)
    assert tiny.open(IDENTITY, pin_memory=False) == 0
    assert not tiny.put(KEYS[0], NS, block(0)) and KEYS[0] not in tiny


# --- the block manager over the host tier, in process ---------------------------------------------


def allocator(tmp_path: Path, host_blocks: int | None, disk: bool = False) -> InProcessAllocator:
    return InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=8, block_size=4),
                              kv_disk_dir=tmp_path / "tier" if disk else None,
                              kv_host_bytes=host_blocks * BLOCK_BYTES if host_blocks is not None else None,
                              model_fingerprint="model-a")


def evict(alloc: InProcessAllocator) -> None:
    """A client without a tier identity (as an untrusted client of the service) takes every block
    of the pool: every cached block is evicted, and nothing of its own reaches a tier. Then the pool
    is zeroed: whatever comes back comes from a tier."""
    manager = alloc.block_manager
    with alloc._lock:
        if "guest" not in manager._client_seqs:
            manager.add_client("guest")
        [result] = manager.apply("guest", [AllocateOp("g", other_prompt(), 32, namespace="other")])
        assert result.ok
        manager.apply("guest", [FreeOp("g")])
    alloc.pool.zero_()


def commit_prompt(alloc: InProcessAllocator, namespace: str = "ns") -> list[int]:
    """PROMPT's blocks, each filled with its position + 1, committed (queued for the tiers): their ids."""
    [result] = alloc.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace=namespace)])
    assert result.ok and result.num_cached_tokens == 0
    for position, block_id in enumerate(result.block_ids):
        alloc.pool[:, :, block_id] = float(position + 1)
    alloc.step([FreeOp("s1")])
    return result.block_ids


def write_prompt(alloc: InProcessAllocator, namespace: str = "ns") -> None:
    """PROMPT's blocks committed (``commit_prompt``), copied into every tier (3 blocks written to
    each), then evicted from the pool."""
    commit_prompt(alloc, namespace)
    wait_for(lambda: all(t.num_bytes_written >= 3 * BLOCK_BYTES for t in alloc.stats().tiers))
    evict(alloc)


def assert_prompt_bytes(alloc: InProcessAllocator, block_ids: list[int]) -> None:
    for position, block_id in enumerate(block_ids[:3]):
        assert (alloc.pool[:, :, block_id] == float(position + 1)).all()


def test_evicted_blocks_come_back_from_host_ram_as_cached_tokens(tmp_path: Path) -> None:
    """Host tier alone (no directory): a second chance for evicted blocks."""
    alloc = allocator(tmp_path, host_blocks=16)
    try:
        write_prompt(alloc)
        result, loaded = load(alloc, "s3")
        assert loaded and result.ok and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)
        [host] = alloc.stats().tiers
        assert (host.kind, host.num_blocks, host.num_bytes, host.capacity_bytes) == (
            "host", 3, 3 * BLOCK_BYTES, 16 * BLOCK_BYTES)
        # (The miss: PROMPT's first allocation, which found nothing past the pool either.)
        assert (host.num_hits, host.num_misses, host.num_loads, host.num_bytes_read) == (3, 1, 1, 3 * BLOCK_BYTES)
        assert alloc.stats().prefix_cache_hits == 12
        assert not (tmp_path / "tier").exists()
        assert not alloc.tier.tiers["host"].is_pinned  # a CPU pool: plain host memory (page-locked only for CUDA)
        assert alloc.check_integrity() is None
    finally:
        alloc.close()


def test_host_evictions_are_still_on_disk_and_a_restart_finds_the_disk(tmp_path: Path) -> None:
    """Write-through: every block reaches the disk too. A host tier of 2 blocks keeps PROMPT's last
    two, the disk all three; a load takes each block from the fastest tier holding it."""
    alloc = allocator(tmp_path, host_blocks=2, disk=True)
    try:
        write_prompt(alloc)
        wait_for(lambda: alloc.stats().tiers[1].num_blocks == 3)
        keys = alloc.tier.tiers["host"].keys()
        assert len(keys) == 2 and all(key in alloc.tier.tiers["disk"] for key in keys)
        result, loaded = load(alloc, "s3")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)
        host, disk = alloc.stats().tiers
        assert (host.kind, disk.kind) == ("host", "disk")
        # The first block from disk (a host miss), the other two from RAM; PROMPT's first allocation
        # found nothing (a miss of each).
        assert (host.num_hits, host.num_misses, disk.num_hits, disk.num_misses) == (2, 2, 1, 1)
        assert (host.num_loads, disk.num_loads, host.num_bytes_read) == (1, 1, 2 * BLOCK_BYTES)
        # On its way the disk block would have gone into RAM, whose two slots this load held: dropped.
        assert (host.num_blocks, host.num_write_errors, disk.num_blocks) == (2, 1, 3)
        assert alloc.tier.tiers["host"].keys() == keys
        assert alloc.check_integrity() is None
    finally:
        alloc.close()

    restarted = allocator(tmp_path, host_blocks=2, disk=True)  # RAM is empty; the disk is not
    try:
        assert [t.num_blocks for t in restarted.stats().tiers] == [0, 3]
        result, loaded = load(restarted, "s1")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(restarted, result.block_ids)
        host, disk = restarted.stats().tiers
        assert (host.num_hits, disk.num_hits, host.num_blocks) == (0, 3, 2)  # two of them now in RAM too
    finally:
        restarted.close()


def test_a_block_loaded_from_ram_that_the_disk_lacks_is_written_to_the_disk(tmp_path: Path) -> None:
    """A restart must find what RAM served: PROMPT's disk writes failed (the directory's path is a
    plain file for a while), RAM kept the blocks; a load from RAM queues them for the disk again."""
    alloc = allocator(tmp_path, host_blocks=16, disk=True)
    directory = tmp_path / "tier"
    try:
        directory.rename(tmp_path / "away")
        directory.write_bytes(b"")  # a real write error, whoever runs the test (ENOTDIR)
        commit_prompt(alloc)
        wait_for(lambda: alloc.stats().tiers[1].num_write_errors == 3)
        evict(alloc)
        directory.unlink()
        (tmp_path / "away").rename(directory)
        assert [t.num_blocks for t in alloc.stats().tiers] == [3, 0]
        result, loaded = load(alloc, "s3")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)
        wait_for(lambda: alloc.stats().tiers[1].num_blocks == 3)
        assert all(key in alloc.tier.tiers["disk"] for key in alloc.tier.tiers["host"].keys())
    finally:
        alloc.close()
    restarted = allocator(tmp_path, host_blocks=16, disk=True)
    try:
        result, loaded = load(restarted, "s1")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(restarted, result.block_ids)
    finally:
        restarted.close()


def test_blocks_evicted_before_the_writer_reaches_them_are_counted_missed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer behind the engine (a low-priority thread under saturation; here: its staging full, no RAM tier
    to copy into) finds PROMPT's blocks evicted when it comes: not kept, and counted."""
    monkeypatch.setattr(worker, "STAGING_BYTES", 0)
    alloc = allocator(tmp_path, host_blocks=None, disk=True)
    try:
        [result] = alloc.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace="ns")])
        alloc.step([FreeOp("s1")])  # 3 full blocks committed, queued for the disk
        evict(alloc)
        monkeypatch.setattr(worker, "STAGING_BYTES", 256 << 20)
        alloc.step([])  # wakes the writer
        wait_for(lambda: alloc.stats().tiers[0].num_blocks_missed == 3)
        [disk] = alloc.stats().tiers
        assert (disk.num_blocks, disk.num_bytes_written) == (0, 0)  # the guest's blocks have no tier key
        result, loaded = load(alloc, "s2")
        assert not loaded and result.ok and result.num_cached_tokens == 0
    finally:
        alloc.close()


def test_a_copy_of_a_block_handed_out_meanwhile_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer copies without the manager's lock; a Step may evict the block and hand it out
    (to be rewritten) during the copy: the generation it read at take time says so afterwards."""
    monkeypatch.setattr(worker, "STAGING_BYTES", 0)  # the writer takes nothing: this test does
    alloc = allocator(tmp_path, host_blocks=None, disk=True)
    manager = alloc.block_manager
    try:
        [result] = alloc.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace="ns")])
        alloc.step([FreeOp("s1")])
        with alloc._lock:
            taken = manager.take_tier_writes(10)
            assert [t[0] for t in taken] == result.block_ids[:3]
            assert [manager.is_unchanged(b, g) for b, _, _, g, _ in taken] == [True] * 3  # nothing happened yet
        evict(alloc)  # every block handed out again (the copies would now be torn)
        with alloc._lock:
            assert [manager.is_unchanged(b, g) for b, _, _, g, _ in taken] == [False] * 3
        assert alloc.stats().tiers[0].num_blocks_missed == 3
        assert alloc.stats().tiers[0].num_blocks == 0
    finally:
        alloc.close()


def test_a_full_staging_without_a_host_tier_leaves_blocks_in_the_book(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for one staged copy, no RAM tier: the writer takes one block at a time from the book and
    every committed block reaches the disk (none is copied to nowhere and dropped unseen)."""
    monkeypatch.setattr(worker, "STAGING_BYTES", BLOCK_BYTES)
    alloc = allocator(tmp_path, host_blocks=None, disk=True)
    try:
        commit_prompt(alloc)
        wait_for(lambda: alloc.stats().tiers[0].num_blocks == 3)
        assert alloc.stats().tiers[0].num_blocks_missed == 0
        evict(alloc)
        result, loaded = load(alloc, "s2")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)
    finally:
        alloc.close()


def test_a_block_taken_again_for_the_same_tokens_is_not_written_with_other_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PROMPT's blocks, queued for the disk, are evicted, rewritten by a guest, freed, and taken again
    for PROMPT (recomputed: pending, their K/V not written yet). They carry PROMPT's keys again, but
    their bytes are the guest's: the queued writes must not persist them (the generation they were
    committed at is gone)."""
    monkeypatch.setattr(worker, "STAGING_BYTES", 0)  # the writer takes nothing: this test does
    alloc = allocator(tmp_path, host_blocks=None, disk=True)
    manager = alloc.block_manager
    try:
        [first] = alloc.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace="ns")])
        alloc.step([FreeOp("s1")])  # committed, queued
        evict(alloc)  # the guest takes every block...
        alloc.pool.fill_(99.0)  # ...and writes its own K/V into them
        [again] = alloc.step([AllocateOp("s2", PROMPT, len(PROMPT), namespace="ns")])
        assert again.ok and again.num_cached_tokens == 0 and again.block_ids[:3] == first.block_ids[:3]
        with alloc._lock:
            assert manager.take_tier_writes(10) == []  # nothing of the guest's under PROMPT's keys
        assert alloc.stats().tiers[0].num_blocks_missed == 3
    finally:
        alloc.close()


def test_host_tier_keeps_tenants_apart(tmp_path: Path) -> None:
    alloc = allocator(tmp_path, host_blocks=16)
    try:
        write_prompt(alloc, namespace="tenant-a")
        result, loaded = load(alloc, "s3", namespace="tenant-b")
        assert not loaded and result.ok and result.num_cached_tokens == 0
        alloc.step([FreeOp("s3")])
        evict(alloc)
        result, loaded = load(alloc, "s4", namespace="tenant-a")
        assert loaded and result.num_cached_tokens == 12
    finally:
        alloc.close()


def test_blocks_of_a_client_without_a_tier_identity_never_reach_the_host_tier(tmp_path: Path) -> None:
    alloc = allocator(tmp_path, host_blocks=16)
    try:
        manager = alloc.block_manager
        with alloc._lock:
            manager.add_client("guest")  # no tier identity: as an untrusted client of the service
            manager.apply("guest", [AllocateOp("g1", PROMPT, len(PROMPT), namespace="ns")])
            manager.apply("guest", [FreeOp("g1")])  # committed and cached
            assert manager.take_tier_writes(100) == []
        evict(alloc)
        result, loaded = load(alloc, "s3")
        assert not loaded and result.num_cached_tokens == 0
        [host] = alloc.stats().tiers
        assert (host.num_hits, host.num_bytes_written) == (0, 0)
    finally:
        alloc.close()


def test_each_tier_is_weighed_at_its_own_read_speed(tmp_path: Path) -> None:
    """Load or recompute: each load is weighed with the measured bandwidths of the tiers it would
    read (set here: RAM at 1 TB/s, the disk at 1 KB/s), and a skipped load counts for each."""
    alloc = allocator(tmp_path, host_blocks=2, disk=True)
    try:
        write_prompt(alloc)  # PROMPT's blocks 1 and 2 in RAM, all three on disk
        wait_for(lambda: alloc.stats().tiers[1].num_blocks == 3)
        worker = alloc.tier
        tally = worker.accounts._tally
        tally["host"].read_bytes_per_s, tally["disk"].read_bytes_per_s = 1e12, 1e3
        in_ram = alloc.tier.tiers["host"].keys()
        # 2 blocks in RAM: 1 KB at 1 TB/s against 8 tokens at 1,000 tokens/s: load.
        assert worker.worth_loading(in_ram, prefill_tokens_per_s=1000.0)
        # All three: + 512 bytes at 1 KB/s (0.5 s) against 12 tokens (12 ms): recompute.
        result, loaded = load(alloc, "s3", prefill_tokens_per_s=1000.0)
        assert not loaded and result.ok and result.num_cached_tokens == 0
        host, disk = alloc.stats().tiers
        assert (host.num_loads_skipped, disk.num_loads_skipped, host.num_loads, disk.num_loads) == (1, 1, 0, 0)
        assert (host.num_hits, disk.num_hits) == (2, 1)
    finally:
        alloc.close()


@pytest.mark.parametrize(("fields", "needle"), [
    ({"kv_host_bytes": 0}, "kv_host_bytes must be an integer >= 1, got 0"),
    ({"kv_host_bytes": -5}, "kv_host_bytes must be an integer >= 1, got -5"),
    ({"kv_host_bytes": 1 << 20, "enable_prefix_caching": False}, "kv_host_bytes needs enable_prefix_caching"),
])
def test_config_checks_the_host_tier_flag(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        MemoryServiceConfig(**fields)


@pytest.mark.parametrize(("value", "needle"), [("0", "kv_host_bytes must be an integer >= 1, got 0"),
                                               ("lots", "--kv-host-bytes: invalid int value: 'lots'")])
def test_memory_service_refuses_a_bad_host_tier_flag(value: str, needle: str) -> None:
    """``python -m memory_service --kv-host-bytes`` with a bad value exits 2 naming the flag, before serving."""
    proc = subprocess.run([sys.executable, "-m", "memory_service", "--kv-host-bytes", value],
                          capture_output=True, text=True, timeout=60, env={**os.environ})
    assert proc.returncode == 2 and needle in proc.stderr


def test_memory_service_refuses_a_host_tier_larger_than_ram_at_start(tmp_path: Path) -> None:
    """Before serving (exit 1, naming the flag), not at the first trusted Attach (INTERNAL, each time)."""
    proc = subprocess.run([sys.executable, "-m", "memory_service", "--socket", str(tmp_path / "memory.sock"),
                           "--kv-host-bytes", str(1 << 60)], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert proc.returncode == 1 and f"--kv-host-bytes {1 << 60} is more than this machine's RAM" in proc.stderr
    assert not (tmp_path / "memory.sock").exists()


def test_in_process_host_tier_needs_a_fingerprint_and_a_sound_budget(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a model_fingerprint"):
        InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=8, block_size=4), kv_host_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_host_bytes must be >= 1"):
        InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=8, block_size=4), kv_host_bytes=0,
                           model_fingerprint="model-a")


def test_a_load_cut_short_counts_only_the_bytes_it_read(tmp_path: Path) -> None:
    """A load pins every host block it may read first; when it stops on a block no tier holds any
    more (evicted between the lookup and the load), the host blocks after it were never read and
    count no bytes read."""
    alloc = allocator(tmp_path, host_blocks=16)
    try:
        write_prompt(alloc)
        host = alloc.tier.tiers["host"]
        keys = host.keys()
        # The load starts; its loader waits at its first acquire while a block goes. (The writer has
        # nothing to put meanwhile: every block of PROMPT is written, the guest's are never queued.)
        with host._lock:
            [reply] = alloc.step_with_counts([AllocateOp("s3", PROMPT, len(PROMPT), namespace="ns")]).results
            assert reply.loading
            host._free_slots.append(host._index.pop(keys[1]).slot)  # PROMPT's middle block
        result, _ = load(alloc, "s3")  # waits for the load's report if it still runs
        assert result.ok and result.num_cached_tokens == 4  # the first block; the rest recomputed
        [stats] = alloc.stats().tiers
        assert stats.num_bytes_read == BLOCK_BYTES
        assert alloc.check_integrity() is None
    finally:
        alloc.close()


def test_tiers_opening_while_the_service_closes_start_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Attach that opens the tiers (its host buffer slow to allocate) while the service closes is
    answered UNAVAILABLE, and no tier thread starts over the pool that close freed (close saw no
    tier yet); before, it was INTERNAL (the pool gone), or threads over a freed pool."""
    import asyncio
    import threading

    from memory_service.service.servicer import MemoryManagerServicer
    from pagedserve.errors import UnavailableError

    entered, go = threading.Event(), threading.Event()
    real_open = HostTier.open

    def slow_open(self: HostTier, identity: TierIdentity, pin_memory: bool) -> int:
        entered.set()
        assert go.wait(20)
        return real_open(self, identity, pin_memory)

    monkeypatch.setattr(HostTier, "open", slow_open)

    async def scenario() -> MemoryManagerServicer:
        servicer = MemoryManagerServicer(MemoryServiceConfig(max_num_blocks=8, block_size=4, kv_host_bytes=1 << 16))
        await servicer._ensure_pool(LAYOUT)
        opening = asyncio.ensure_future(servicer._tier_identity("model-a", is_trusted=True))
        assert await asyncio.to_thread(entered.wait, 20)
        await servicer.close()
        go.set()
        with pytest.raises(UnavailableError, match="shutting down"):
            await opening
        return servicer

    servicer = asyncio.run(scenario())
    assert servicer.tier is None and servicer.pool is None
    assert [t.name for t in threading.enumerate() if t.name.startswith("kv-tier")] == []


def test_a_slow_disk_does_not_hold_back_the_host_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write-through with a disk slower than the commits: once the disk's staging is full, committed
    blocks still go into RAM at once (the disk writes them later, from there), instead of waiting in
    the book for the disk, where an eviction meanwhile lost them for both tiers."""
    import threading

    from memory_service.tier import worker
    from memory_service.tier.disk_tier import DiskTier

    monkeypatch.setattr(worker, "STAGING_BYTES", BLOCK_BYTES)  # one staged copy at a time
    monkeypatch.setattr(worker, "WRITE_BATCH_BLOCKS", 1)
    disk_free = threading.Event()
    real_put = DiskTier.put_buffer  # every write (``put`` too) goes through it

    def slow_put(self: DiskTier, key: bytes, ns_key: bytes, buffer, origin=None) -> bool:
        assert disk_free.wait(20)
        return real_put(self, key, ns_key, buffer, origin)

    monkeypatch.setattr(DiskTier, "put_buffer", slow_put)
    alloc = allocator(tmp_path, host_blocks=16, disk=True)
    try:
        commit_prompt(alloc)
        wait_for(lambda: alloc.stats().tiers[0].num_blocks == 3)  # all in RAM, the disk still busy
        assert alloc.stats().tiers[1].num_blocks == 0
        disk_free.set()
        wait_for(lambda: alloc.stats().tiers[1].num_blocks == 3)  # and every one reaches the disk
        evict(alloc)
        result, loaded = load(alloc, "s2")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)
        assert all(key in alloc.tier.tiers["disk"] for key in alloc.tier.tiers["host"].keys())
        assert alloc.check_integrity() is None
    finally:
        disk_free.set()
        alloc.close()
