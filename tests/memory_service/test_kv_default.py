"""The CPU pool's size when none is given: the least of a cap, a quarter of available RAM and 90% of
free /dev/shm, logged by the memory service."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from memory_service.api import KvLayout, MemoryClient
from memory_service.config import DEFAULT_CPU_KV_CAP_BYTES
from memory_service.pool import kv_pool
from pagedserve.stack import memory_process, ready

# SmolLM2-135M's layout in float32: 720 KiB a block, so 2 GiB stays far below MAX_NUM_BLOCKS.
LAYOUT = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16)


@pytest.mark.parametrize(("ram", "shm", "expected"), [
    (64 << 30, 64 << 30, DEFAULT_CPU_KV_CAP_BYTES),  # a large host: the cap
    (4 << 30, 64 << 30, 1 << 30),  # little RAM: a quarter of it
    (64 << 30, 1 << 30, int((1 << 30) * 0.9)),  # a small /dev/shm (a container's 64 MiB default, say)
])
def test_cpu_default_is_the_least_of_cap_ram_quarter_and_shm_share(monkeypatch, ram: int, shm: int,
                                                                   expected: int) -> None:
    monkeypatch.setattr(kv_pool, "available_ram_bytes", lambda: ram)
    monkeypatch.setattr(kv_pool, "shm_free_bytes", lambda: shm)
    budget, sources = kv_pool.default_kv_budget("cpu", 0.9)
    assert budget == expected
    assert sources == {"cap_bytes": DEFAULT_CPU_KV_CAP_BYTES, "quarter_available_ram_bytes": ram // 4,
                       "shm_share_bytes": int(shm * 0.9)}


def test_service_without_a_size_uses_the_default_and_logs_it() -> None:
    directory = tempfile.mkdtemp(prefix="pskv-")
    socket, log_file = os.path.join(directory, "memory.sock"), Path(directory, "memory_service.log")
    service = ready(memory_process(socket, ["--block-size", "16"], log_file=log_file), 30)
    try:
        with MemoryClient(f"unix:{socket}", LAYOUT, "sizing") as client:
            num_blocks = client.num_blocks
    finally:
        status = service.stop()
        log_text = log_file.read_text()
        shutil.rmtree(directory, ignore_errors=True)
    assert status == 0
    events = [json.loads(line) for line in log_text.splitlines() if "kv_pool_sized" in line]
    assert len(events) == 1, log_text[-2000:]
    sized = events[0]
    assert sized["cap_bytes"] == DEFAULT_CPU_KV_CAP_BYTES
    chosen = min(sized["cap_bytes"], sized["quarter_available_ram_bytes"], sized["shm_share_bytes"])
    assert sized["num_bytes"] == chosen
    assert num_blocks == chosen // LAYOUT.bytes_per_block
    assert not list(Path("/dev/shm").glob(f"pagedserve-kv-{service.pid}-*"))
