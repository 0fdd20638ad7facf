"""KV events of a real memory service, read by a subscriber built on vLLM's own classes.

benchmarks/kv_events_subscriber.py runs under vLLM's python (its venv: pagedserve_testing/vllm_venv.py) and
decodes every batch with vLLM's ``KVEventBatch`` decoder, as a router built on vLLM would: the blocks
it rebuilds, per medium (the pool "GPU", the host tier "CPU", the disk tier "DISK"), with their
tokens, parents and tenants, must be what was committed and evicted, and as many as the Stats RPC
says each medium holds. Then the memory service restarts on the same tier directory: the subscriber
notices (the sequence starts over), forgets everything at the new ``AllBlocksCleared``, learns the
disk tier's blocks again (announced from its files, medium "DISK", the same hashes and parents), and
follows the new service. Skipped where vLLM's venv is absent (CI has none).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve_testing.vllm_venv import vllm_python
from memory_service.api import AllocateOp, FreeOp, MemoryClient, cache_namespace
from memory_service.manager.prefix_cache import namespace_key
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from tests.memory_service.conftest import TINY_LAYOUT, start_memory_service

SUBSCRIBER = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_events_subscriber.py"
TOKEN = "memory-token-0123456789abcdef"
BLOCK_SIZE = 4
NUM_POOL_BLOCKS = 8
SALTED = cache_namespace("model-a", "tenant-a")
UNSALTED = cache_namespace("model-a")
SALTED_PROMPT = list(range(100, 113))  # 3 full blocks and one token
UNSALTED_PROMPT = list(range(200, 213))
BIG_PROMPT = list(range(500, 532))  # the whole pool: evicts every cached block


def find_vllm_python() -> Path | None:
    try:
        python = vllm_python(install=False)
    except FileNotFoundError:
        return None
    return python if python.exists() else None  # a $VLLM_PYTHON that is not there


VLLM_PYTHON = find_vllm_python()
pytestmark = pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM's venv (.venv-vllm or $VLLM_PYTHON) is absent: "
                                                            "scripts/vllm_venv.sh creates it")


class VllmSubscriber:
    """The subscriber process: its SUB socket bound where the memory service's PUB connects."""

    def __init__(self, port: int, replay_port: int) -> None:
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(SUBSCRIBER), "--bind", "--endpoint", f"tcp://127.0.0.1:{port}",
             "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        line = self.process.stdout.readline()  # vLLM's import takes seconds
        assert line.strip() == "ready", f"the subscriber did not start: {line!r}"

    def dump(self) -> dict:
        self.process.stdin.write("dump\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> int:
        self.process.stdin.close()
        try:
            return self.process.wait(10)
        finally:
            self.process.kill()


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture
def subscriber(ports: tuple[int, int]) -> Iterator[VllmSubscriber]:
    subscriber = VllmSubscriber(*ports)
    try:
        yield subscriber
    finally:
        subscriber.close()


def blocks_of(tokens: list[int]) -> list[list[int]]:
    return [tokens[i:i + BLOCK_SIZE] for i in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE)]


def by_tokens(dump: dict, medium: str) -> dict[tuple[int, ...], dict]:
    return {tuple(b["token_ids"]): b for b in dump["media"].get(medium, [])}


def commit(client: MemoryClient, seq_id: str, prompt: list[int], namespace: str) -> None:
    [result] = client.step([AllocateOp(seq_id, prompt, len(prompt), namespace=namespace)])
    assert result.ok
    client.step([FreeOp(seq_id)])


def wait_for_tiers(client: MemoryClient, num_blocks: int) -> None:
    wait_until(lambda: [t.num_blocks for t in client.stats().tiers] == [num_blocks] * 2, 30,
               f"{num_blocks} blocks in each tier", interval_s=0.05)


def matches_stats(subscriber: VllmSubscriber, client: MemoryClient) -> bool:
    stats, media = client.stats(), subscriber.dump()["media"]
    host, disk = stats.tiers  # fastest first
    return (len(media.get("GPU", [])) == sum(p.num_cached_blocks for p in stats.pools)
            and len(media.get("CPU", [])) == host.num_blocks and len(media.get("DISK", [])) == disk.num_blocks)


def test_a_vllm_subscriber_rebuilds_the_blocks_of_each_medium_and_follows_a_restart(
        subscriber: VllmSubscriber, ports: tuple[int, int], tmp_path: Path) -> None:
    port, replay_port = ports
    token_file = tmp_path / "memory.token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    flags = ("--max-num-blocks", str(NUM_POOL_BLOCKS), "--kv-disk-dir", str(tmp_path / "tier"),
             "--kv-host-bytes", str(64 * TINY_LAYOUT.bytes_per_block), "--auth-token-file", str(token_file),
             "--kv-events-endpoint", f"tcp://127.0.0.1:{port}",
             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}")
    subscriber.wait_ready()
    service, socket = start_memory_service(*flags)
    try:
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, token=TOKEN, model_fingerprint="model-a") as client:
            commit(client, "salted", SALTED_PROMPT, SALTED)
            commit(client, "unsalted", UNSALTED_PROMPT, UNSALTED)
            wait_for_tiers(client, 6)  # written before they are evicted
            commit(client, "big", BIG_PROMPT, UNSALTED)  # evicts the 6 blocks above from the pool
            wait_for_tiers(client, 14)
            wait_until(lambda: matches_stats(subscriber, client), 30, "the subscriber's index to match Stats",
                       interval_s=0.2)
            dump = subscriber.dump()
            assert dump["history"][0] == ["AllBlocksCleared", None, 0]

            # The pool holds the big prompt's blocks; both tiers hold every block committed.
            salted, unsalted, big = blocks_of(SALTED_PROMPT), blocks_of(UNSALTED_PROMPT), blocks_of(BIG_PROMPT)
            assert sorted(by_tokens(dump, "GPU")) == sorted(map(tuple, big))
            for medium in ("CPU", "DISK"):
                assert sorted(by_tokens(dump, medium)) == sorted(map(tuple, salted + unsalted + big))
            # One content, one hash in every medium; each block chained to the one before it.
            gpu, host, disk = (by_tokens(dump, m) for m in ("GPU", "CPU", "DISK"))
            assert all(gpu[t]["hash"] == disk[t]["hash"] == host[t]["hash"] for t in gpu)
            for blocks in (salted, unsalted, big):
                chain = [disk[tuple(b)] for b in blocks]
                assert [b["parent"] for b in chain] == [None] + [b["hash"] for b in chain[:-1]]
            # The tenant's blocks carry its namespace key (vLLM's extra_keys); unsalted ones none.
            tenant = [namespace_key(SALTED).hex()]
            assert [disk[tuple(b)]["extra_keys"] for b in salted] == [tenant] * 3
            assert {str(disk[tuple(b)]["extra_keys"]) for b in unsalted + big} == {"None"}
            num_batches = dump["num_batches"]
            assert sum(n for kind, medium, n in dump["history"] if kind == "BlockRemoved" and medium == "GPU") == 6
            assert client.check_integrity() is None
        assert service.stop() == 0

        service, socket = start_memory_service(*flags)  # the same tier directory
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, token=TOKEN, model_fingerprint="model-a") as client:
            wait_until(lambda: subscriber.dump()["num_restarts"] == 1, 30, "the subscriber to see the restart",
                       interval_s=0.2)
            # The disk tier's files are announced, after the new start's AllBlocksCleared: the same
            # blocks, hashes and parents as before the restart, and what Stats counts.
            wait_until(lambda: matches_stats(subscriber, client) and client.stats().tiers[1].num_blocks == 14, 30,
                       "the disk tier's blocks announced", interval_s=0.2)
            dump = subscriber.dump()
            history = dump["history"]
            restart = len(history) - 1 - history[::-1].index(["AllBlocksCleared", None, 0])
            assert {kind for kind, _, _ in history[restart + 1:]} == {"BlockStored"}
            assert {medium for _, medium, _ in history[restart + 1:]} == {"DISK"}
            assert len(history) - restart - 1 == 3  # one event per chain: the salted, unsalted and big prompts
            found = by_tokens(dump, "DISK")
            assert {t: (b["hash"], b["parent"]) for t, b in found.items()} == {
                t: (b["hash"], b["parent"]) for t, b in disk.items()}
            assert [found[tuple(b)]["extra_keys"] for b in salted] == [tenant] * 3
            fresh = list(range(300, 309))  # 2 full blocks, in no tier
            commit(client, "fresh", fresh, UNSALTED)
            wait_until(lambda: len(subscriber.dump()["media"].get("GPU", [])) == 2, 30, "2 blocks in the pool",
                       interval_s=0.2)
            dump = subscriber.dump()
            # The pool holds the new blocks alone; the disk keeps what it had, and the new ones.
            assert dump["history"].count(["AllBlocksCleared", None, 0]) == 2 and dump["num_batches"] > num_batches
            assert sorted(by_tokens(dump, "GPU")) == sorted(map(tuple, blocks_of(fresh)))
            assert set(map(tuple, salted + unsalted + big)) <= set(by_tokens(dump, "DISK"))
            assert not set(by_tokens(dump, "CPU")) - set(map(tuple, blocks_of(fresh)))  # RAM did not survive
            assert client.check_integrity() is None
    finally:
        service.stop()
    assert subscriber.close() == 0
