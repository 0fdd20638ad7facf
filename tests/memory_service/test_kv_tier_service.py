"""The disk tier over gRPC, against real memory-service processes: the ``loading`` contract, the
bytes that come back, an untrusted client's blocks never persisted, the Stats RPC's and Prometheus'
tier figures, and a restarted service on the same directory."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from memory_service.api import AllocateOp, FreeOp, KvLayout, MemoryClient
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from tests.memory_service.conftest import TINY_LAYOUT, start_memory_service

TOKEN = "memory-token-0123456789abcdef"
PROMPT = list(range(100, 113))  # block size 4: 3 full blocks and one token


def wait_for_tier_blocks(client: MemoryClient, num_blocks: int) -> None:
    wait_until(lambda: client.stats().tiers and client.stats().tiers[0].num_blocks >= num_blocks, 30,
               f"{num_blocks} blocks in the tier", interval_s=0.02)


def load_prompt(client: MemoryClient, seq_id: str):
    """PROMPT's AllocateOp: answered ``loading``, reported loaded by a later Step, then a pool hit."""
    op = AllocateOp(seq_id, PROMPT, len(PROMPT), namespace="ns")
    [result] = client.step([op])
    assert result.loading and not result.ok and result.block_ids == []
    reported: list[str] = []
    deadline = time.monotonic() + 30
    while seq_id not in reported:
        assert time.monotonic() < deadline, "the load was never reported"
        time.sleep(0.01)
        reported += client.step_with_counts([]).loaded_seq_ids
    [result] = client.step([op])
    assert result.ok and result.num_cached_tokens == 12
    return result


def test_tier_over_grpc_and_after_a_restart(tmp_path: Path) -> None:
    token_file = tmp_path / "memory.token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    tier_dir, port = tmp_path / "tier", free_port()
    flags = ("--max-num-blocks", "8", "--kv-disk-dir", str(tier_dir), "--auth-token-file", str(token_file),
             "--max-untrusted-client-blocks", "8")
    service, socket = start_memory_service(*flags, "--metrics-port", str(port))
    try:
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, token=TOKEN, model_fingerprint="model-a") as client, \
                MemoryClient(f"unix:{socket}", TINY_LAYOUT, client_name="guest") as guest:
            [result] = guest.step([AllocateOp("g", list(range(900, 913)), 13)])  # untrusted: never persisted
            guest.step([FreeOp("g")])
            [result] = client.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace="ns")])
            for position, block_id in enumerate(result.block_ids):
                client.pool[:, :, block_id] = float(position + 1)
            client.step([FreeOp("s1")])
            wait_for_tier_blocks(client, 3)
            client.step([AllocateOp("big", list(range(500, 532)), 32, namespace="ns")])  # evicts everything
            client.step([FreeOp("big")])
            wait_for_tier_blocks(client, 11)
            client.pool.zero_()
            result = load_prompt(client, "s2")
            for position, block_id in enumerate(result.block_ids[:3]):
                assert (client.pool[:, :, block_id] == float(position + 1)).all()
            [tier] = client.stats().tiers
            assert (tier.kind, tier.num_blocks, tier.num_hits, tier.num_loads) == ("disk", 11, 3, 1)
            first = (client.memory_service_id, client.memory_service_epoch)
            assert client.check_integrity() is None
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'pagedserve_memory_tier_blocks{tier="disk"} 11.0' in body
        assert 'pagedserve_memory_tier_load_seconds_count{tier="disk"} 1.0' in body
        assert f'pagedserve_memory_tier_missed_blocks_total{{tier="disk"}} {float(tier.num_blocks_missed)}' in body
        assert service.stop() == 0

        service, socket = start_memory_service(*flags)  # a new service on the same directory
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, token=TOKEN, model_fingerprint="model-a") as client:
            # The same cache (its id, kept in the directory), but a new epoch: its pool started empty.
            assert client.memory_service_id == first[0] and len(client.memory_service_epoch) == 16
            assert client.memory_service_epoch != first[1]
            result = load_prompt(client, "s1")
            assert (client.pool[:, :, result.block_ids[1]] == 2.0).all()
    finally:
        service.stop()


def test_host_tier_over_grpc_in_front_of_the_disk(tmp_path: Path) -> None:
    """``--kv-host-bytes`` on a real service, with a disk tier behind it: told at Attach (fastest
    first), an evicted prompt comes back from RAM, an untrusted client's blocks reach neither tier,
    Stats and Prometheus report each tier under its label; a restart finds the disk, not the RAM."""
    token_file = tmp_path / "memory.token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    tier_dir, port = tmp_path / "tier", free_port()
    block_bytes = TINY_LAYOUT.bytes_per_block
    flags = ("--max-num-blocks", "8", "--kv-disk-dir", str(tier_dir), "--kv-host-bytes", str(64 * block_bytes),
             "--auth-token-file", str(token_file), "--max-untrusted-client-blocks", "8")
    service, socket = start_memory_service(*flags, "--metrics-port", str(port))
    try:
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, token=TOKEN, model_fingerprint="model-a") as client, \
                MemoryClient(f"unix:{socket}", TINY_LAYOUT, client_name="guest") as guest:
            assert [(t.kind, t.capacity_bytes) for t in client.tiers] == [("host", 64 * block_bytes),
                                                                          ("disk", 10 << 30)]
            [result] = client.step([AllocateOp("s1", PROMPT, len(PROMPT), namespace="ns")])
            for position, block_id in enumerate(result.block_ids):
                client.pool[:, :, block_id] = float(position + 1)
            client.step([FreeOp("s1")])
            wait_until(lambda: [t.num_blocks for t in client.stats().tiers] == [3, 3], 30, "3 blocks in each tier",
                       interval_s=0.02)
            guest.step([AllocateOp("g", list(range(500, 532)), 32)])  # untrusted: evicts all, kept nowhere
            guest.step([FreeOp("g")])
            client.pool.zero_()
            result = load_prompt(client, "s2")
            for position, block_id in enumerate(result.block_ids[:3]):
                assert (client.pool[:, :, block_id] == float(position + 1)).all()
            host, disk = client.stats().tiers
            assert (host.kind, host.num_blocks, host.num_hits, host.num_loads, host.num_bytes_read) == (
                "host", 3, 3, 1, 3 * block_bytes)
            assert (disk.kind, disk.num_blocks, disk.num_hits, disk.num_loads, disk.num_bytes_read) == (
                "disk", 3, 0, 0, 0)
            assert client.check_integrity() is None
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'pagedserve_memory_tier_blocks{tier="host"} 3.0' in body
        assert 'pagedserve_memory_tier_blocks{tier="disk"} 3.0' in body
        assert 'pagedserve_memory_tier_hits_blocks_total{tier="host"} 3.0' in body
        assert 'pagedserve_memory_tier_load_seconds_count{tier="host"} 1.0' in body
        assert 'pagedserve_memory_tier_load_seconds_count{tier="disk"} 0.0' in body
        assert service.stop() == 0

        service, socket = start_memory_service(*flags)  # RAM is gone; the disk keeps the blocks
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, token=TOKEN, model_fingerprint="model-a") as client:
            result = load_prompt(client, "s1")
            assert (client.pool[:, :, result.block_ids[1]] == 2.0).all()
            host, disk = client.stats().tiers
            assert (host.num_hits, disk.num_hits, host.num_blocks) == (0, 3, 3)
    finally:
        service.stop()


def test_a_clean_stop_right_after_commits_keeps_their_blocks_for_the_restart(tmp_path: Path) -> None:
    """SIGTERM right after a Step commits 64 blocks of 256 KiB: the writer has most of them copied or
    queued, not written; the stop writes them (``TierWorker.close``) and a new service finds all 64."""
    token_file = tmp_path / "memory.token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    layout = KvLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float32", block_size=4)
    flags = ("--max-num-blocks", "72", "--kv-disk-dir", str(tmp_path / "tier"), "--auth-token-file", str(token_file))
    prompt = list(range(1000, 1000 + 64 * 4 + 1))  # 64 full blocks and one token
    service, socket = start_memory_service(*flags)
    try:
        with MemoryClient(f"unix:{socket}", layout, token=TOKEN, model_fingerprint="model-a") as client:
            [result] = client.step([AllocateOp("s1", prompt, len(prompt), namespace="ns")])
            assert result.ok
            client.step([FreeOp("s1")])  # commits the 64 blocks
            assert service.stop() == 0  # SIGTERM
        assert len(list((tmp_path / "tier").glob("*.kv"))) == 64
        service, socket = start_memory_service(*flags)
        with MemoryClient(f"unix:{socket}", layout, token=TOKEN, model_fingerprint="model-a") as client:
            [tier] = client.stats().tiers
            assert (tier.kind, tier.num_blocks) == ("disk", 64)
    finally:
        service.stop()
