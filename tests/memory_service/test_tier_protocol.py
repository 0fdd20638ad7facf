"""A third tier, written here against ``memory_service/tier/tier.py``'s Protocols and nothing else,
plugs into the tier worker as it is: committed blocks reach it, evicted blocks come back from it byte
for byte. A ``MemoryTier`` alone and between the host and disk tiers (fastest first); an ``IoTier``
alone and behind the disk tier (each IO tier gets its own staged copy)."""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedserve.dtypes import DTYPES
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig
from memory_service.manager.chain import BlockOrigin
from memory_service.tier.block_file import TierIdentity
from memory_service.tier.tier import IoTier, MemoryTier, TierCounters
from tests.memory_service.test_host_tier import BLOCK_BYTES, assert_prompt_bytes, write_prompt
from tests.memory_service.test_kv_tier import LAYOUT, load, wait_for

pytestmark = pytest.mark.unit


class DictTier:
    """Blocks in a dict of tensors, LRU within ``num_slots``; a pinned block is never evicted."""

    def __init__(self, num_slots: int) -> None:
        self.kind = "dict"
        self.medium = "CPU"
        self.identity: TierIdentity | None = None
        self.num_slots = num_slots
        self.on_change: Callable[[bytes, bool], None] | None = None
        self._blocks: OrderedDict[bytes, tuple[bytes, torch.Tensor]] = OrderedDict()  # oldest first
        self._pins: dict[bytes, int] = {}
        self._by_slot: list[bytes] = []  # acquire's slot: an index into this
        self._lock = threading.Lock()
        self._num_written = self._num_read = self._num_dropped = 0

    def open(self, identity: TierIdentity, pin_memory: bool) -> int:
        self.identity = identity
        return self.num_slots

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def put(self, key: bytes, ns_key: bytes, block: torch.Tensor) -> bool:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            if len(self._blocks) == self.num_slots:
                victim = next((k for k in self._blocks if not self._pins.get(k)), None)
                if victim is None:
                    self._num_dropped += 1
                    return False
                del self._blocks[victim]
            self._blocks[key] = (ns_key, block.to("cpu", DTYPES[self.identity.dtype], copy=True))
            self._num_written += 1
            return True

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def acquire(self, key: bytes, ns_key: bytes, make_young: bool = True) -> tuple[int, torch.Tensor] | None:
        with self._lock:
            held = self._blocks.get(key)
            if held is None or held[0] != ns_key:
                return None
            if make_young:
                self._blocks.move_to_end(key)
            self._pins[key] = self._pins.get(key, 0) + 1
            self._by_slot.append(key)
            return len(self._by_slot) - 1, held[1]

    def release(self, slot: int, is_read: bool) -> None:
        with self._lock:
            self._pins[self._by_slot[slot]] -= 1
            self._num_read += is_read

    def counters(self) -> TierCounters:
        with self._lock:
            size = self.identity.bytes_per_block
            return TierCounters(len(self._blocks), len(self._blocks) * size, self.num_slots * size,
                                self._num_written * size, self._num_read * size, self._num_dropped)

    def close(self) -> None:
        pass


class BytesTier:
    """An ``IoTier`` whose "files" are bytes in a dict: written from the worker's staged buffers, read
    on its reader threads. No budget: it keeps every block."""

    def __init__(self) -> None:
        self.kind = "bytes"
        self.medium = "DISK"
        self.identity: TierIdentity | None = None
        self.on_change: Callable[[bytes, bool], None] | None = None
        self.blocks: dict[bytes, tuple[bytes, bytes]] = {}  # key -> (ns_key, payload)
        self._num_written = self._num_read = 0

    @property
    def num_slots(self) -> int:
        return 1 << 20

    def open(self, identity: TierIdentity, pin_memory: bool) -> int:
        self.identity = identity
        return len(self.blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def new_buffer(self) -> mmap.mmap:
        return mmap.mmap(-1, self.identity.file_size)

    def put_buffer(self, key: bytes, ns_key: bytes, buffer: mmap.mmap, origin: BlockOrigin | None = None) -> bool:
        offset = self.identity.payload_offset
        return self.put(key, ns_key, memoryview(buffer)[offset:offset + self.identity.bytes_per_block], origin)

    def put(self, key: bytes, ns_key: bytes, payload: memoryview, origin: BlockOrigin | None = None) -> bool:
        assert origin is not None and origin.is_of(key)  # the worker hands every block's origin on
        self.blocks[key] = (ns_key, bytes(payload))
        self._num_written += 1
        return True

    def get(self, key: bytes, ns_key: bytes) -> memoryview | None:
        held = self.blocks.get(key)
        if held is None or held[0] != ns_key:
            return None
        self._num_read += 1
        return memoryview(bytearray(held[1]))  # a copy of its own, as a file read gives

    def take_found(self) -> list[tuple[bytes, bytes, BlockOrigin]]:
        return []  # nothing outlives the process

    def counters(self) -> TierCounters:
        size = self.identity.bytes_per_block
        return TierCounters(len(self.blocks), len(self.blocks) * size, self.num_slots * size,
                            self._num_written * size, self._num_read * size, 0)

    def close(self) -> None:
        pass


def test_the_tiers_written_here_are_each_of_one_kind() -> None:
    assert isinstance(DictTier(4), MemoryTier) and not isinstance(DictTier(4), IoTier)
    assert isinstance(BytesTier(), IoTier) and not isinstance(BytesTier(), MemoryTier)


@pytest.mark.parametrize("make_tier", [lambda: DictTier(num_slots=8), BytesTier], ids=["memory", "io"])
def test_a_third_tier_alone_round_trips_evicted_blocks(make_tier: Callable[[], DictTier | BytesTier]) -> None:
    tier = make_tier()
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=8, block_size=4), kv_tiers=[tier],
                               model_fingerprint="model-a")
    try:
        write_prompt(alloc)  # PROMPT's 3 full blocks committed, copied into the tier, evicted, the pool zeroed
        result, loaded = load(alloc, "s3")
        assert loaded and result.ok and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)  # each block's bytes, back from the tier
        [stats] = alloc.stats().tiers
        assert (stats.kind, stats.num_blocks, stats.num_hits, stats.num_loads, stats.num_bytes_read) == (
            tier.kind, 3, 3, 1, 3 * BLOCK_BYTES)
        assert alloc.tier.tiers == {tier.kind: tier}
        assert alloc.check_integrity() is None
    finally:
        alloc.close()


def test_a_third_tier_between_the_host_and_the_disk(tmp_path: Path) -> None:
    """Written through to all three; a load reads each block from the fastest tier that holds it: the
    host tier keeps PROMPT's last two blocks, so the first comes from the tier written here."""
    tier = DictTier(num_slots=8)
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=8, block_size=4),
                               kv_disk_dir=tmp_path / "tier", kv_host_bytes=2 * BLOCK_BYTES, kv_tiers=[tier],
                               model_fingerprint="model-a")
    try:
        write_prompt(alloc)
        wait_for(lambda: [t.num_blocks for t in alloc.stats().tiers] == [2, 3, 3])
        result, loaded = load(alloc, "s3")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)
        host, third, disk = alloc.stats().tiers
        assert (host.kind, third.kind, disk.kind) == ("host", "dict", "disk")
        assert (host.num_hits, third.num_hits, disk.num_hits) == (2, 1, 0)
        assert (host.num_bytes_read, third.num_bytes_read, disk.num_bytes_read) == (2 * BLOCK_BYTES, BLOCK_BYTES, 0)
        assert alloc.check_integrity() is None
    finally:
        alloc.close()


def test_an_io_tier_behind_the_disk_gets_every_block_too(tmp_path: Path) -> None:
    """Two IO tiers: the pool's block is copied once, into the disk's staged buffer, and from there into
    the second tier's own; both write every block. The disk, first, serves the load."""
    tier = BytesTier()
    alloc = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=8, block_size=4),
                               kv_disk_dir=tmp_path / "tier", kv_tiers=[tier], model_fingerprint="model-a")
    try:
        write_prompt(alloc)
        disk, third = alloc.stats().tiers
        assert (disk.kind, third.kind, disk.num_blocks, third.num_blocks) == ("disk", "bytes", 3, 3)
        # Each block's bytes as the pool held them: position + 1 (write_prompt's fill).
        values = sorted({float(torch.frombuffer(bytearray(payload), dtype=torch.float32)[0])
                         for _, payload in tier.blocks.values()})
        assert values == [1.0, 2.0, 3.0]
        result, loaded = load(alloc, "s3")
        assert loaded and result.num_cached_tokens == 12
        assert_prompt_bytes(alloc, result.block_ids)
        disk, third = alloc.stats().tiers
        assert (disk.num_hits, third.num_hits, third.num_bytes_read) == (3, 0, 0)
        assert alloc.check_integrity() is None
    finally:
        alloc.close()
