"""KV events of a real memory service, read by a plain pyzmq SUB socket and decoded with msgpack, as
a router's subscriber would (vLLM's wire format, memory_service/service/kv_events.py).

A compute service with the tiny model sends real requests; the events must say exactly which blocks
were committed (their tokens, chained hashes, block size, the namespace of their cache salt), in
which medium (the pool "GPU", the host tier "CPU", the disk tier "DISK"), which the pool evicted, and, replayed from
sequence 0, that the service started clean; the holdings rebuilt from them must match the memory
service's Stats.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from memory_service.api import cache_namespace
from memory_service.config import MemoryServiceConfig
from memory_service.manager import kv_events as log_module
from memory_service.manager.kv_events import AllBlocksCleared, BlockRemoved, KvEventLog
from memory_service.manager.prefix_cache import ROOT_ENTRY_ID, namespace_key
from memory_service.service import kv_events as publisher_module
from memory_service.service.kv_events import END_OF_REPLAY, KvEventPublisher, encode_event
from memory_service.token_encoding import encode_token_ids
from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from pagedserve_testing.tiny_model import ServiceModel
from tests.compute_service.service_fixtures import BLOCK_SIZE, Services, running_services

PROMPT = [40, 97, 109, 32, 97, 32, 116, 105, 110, 121]  # 10 tokens: 2 full blocks of 4
TOPIC = "kv-events"
NUM_POOL_BLOCKS = 32  # 128 tokens


class Subscriber:
    """A SUB socket bound where the memory service's PUB connects (llm-d's central indexer does the
    same), and a DEALER socket on the service's replay ROUTER."""

    def __init__(self, context: zmq.Context) -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.sub = context.socket(zmq.SUB)
        self.sub.bind(f"tcp://127.0.0.1:{self.port}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        # A DEALER, not a REQ: one request is answered with one message per batch, then an end marker.
        self.replay_socket = context.socket(zmq.DEALER)
        self.batches: dict[int, list] = {}  # seq -> decoded [ts, events, dp_rank]
        self.num_received = 0  # batches that came through the SUB socket

    def receive(self, timeout_s: float = 0.1) -> None:
        while self.sub.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)
            self.num_received += 1
            timeout_s = 0.01

    def replay(self, start_seq: int) -> dict[int, list]:
        self.replay_socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replayed = {}
        while True:
            assert self.replay_socket.poll(10_000), "no replay answer"
            delimiter, topic, seq, payload = self.replay_socket.recv_multipart()
            assert delimiter == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert (topic, payload) == (b"", b"")
                return replayed
            assert topic == TOPIC.encode()
            replayed[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)

    def events(self) -> list[dict]:
        """Every event so far, in sequence order: as received, and what the SUB socket has not (yet)
        received asked for on the replay socket (a subscriber that joins misses the first batches)."""
        self.receive()
        first_missing = next(s for s in range(len(self.batches) + 1) if s not in self.batches)
        self.batches.update(self.replay(first_missing))
        return [event for seq in sorted(self.batches) for event in self.batches[seq][1]]


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    context = zmq.Context()
    try:
        yield Subscriber(context)
    finally:
        context.destroy(linger=0)


def stored_blocks(events: list[dict], medium: str) -> list[tuple[int, int | None, list[int], str]]:
    """Each block a BlockStored of ``medium`` announced: (hash, parent hash, its tokens, the namespace
    key of its cache salt: None without one)."""
    blocks = []
    for event in events:
        if event["type"] == "BlockStored" and event["medium"] == medium:
            hashes, parent, token_ids = event["block_hashes"], event["parent_block_hash"], event["token_ids"]
            extra_keys = event.get("extra_keys")  # left out without a cache salt (vLLM's default)
            assert event["block_size"] == BLOCK_SIZE and event["lora_id"] is None and event["lora_name"] is None
            assert len(token_ids) == BLOCK_SIZE * len(hashes)
            assert extra_keys is None or len(extra_keys) == len(hashes)
            for i, block_hash in enumerate(hashes):
                [namespace] = extra_keys[i] if extra_keys is not None else [None]
                blocks.append((block_hash, parent, token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], namespace))
                parent = block_hash
    return blocks


def holdings(events: list[dict]) -> dict[str, set[int]]:
    """The blocks each medium holds, rebuilt from the events as a router's index would."""
    held: dict[str, set[int]] = {}
    for event in events:
        if event["type"] == "AllBlocksCleared":
            held.clear()
        elif event["type"] in ("BlockStored", "BlockRemoved"):
            blocks = held.setdefault(event["medium"], set())
            if event["type"] == "BlockStored":
                blocks.update(event["block_hashes"])
            else:
                blocks.difference_update(event["block_hashes"])
    return held


def generate(services: Services, prompt: list[int], max_tokens: int, cache_salt: str = "") -> list[int]:
    replies = services.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_salt=cache_salt)
    return [t for r in replies for t in r.token_ids]


def test_events_follow_real_requests_through_pool_and_tiers(service_model: ServiceModel, subscriber: Subscriber,
                                                            tmp_path: Path) -> None:
    memory_args = ("--max-num-blocks", str(NUM_POOL_BLOCKS), "--kv-host-bytes", str(1 << 20),
                   "--kv-disk-dir", str(tmp_path / "tier"),
                   "--kv-events-endpoint", f"tcp://127.0.0.1:{subscriber.port}",
                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{subscriber.replay_port}")
    with running_services(service_model.path, memory_args=memory_args,
                          compute_args=("--num-speculative-tokens", "0")) as services:
        subscriber.replay_socket.connect(f"tcp://127.0.0.1:{subscriber.replay_port}")
        # The first batch of a start, replayed for a subscriber that joined late.
        assert subscriber.replay(0)[0][1:] == [[{"type": "AllBlocksCleared"}], 0]
        model_name = services.stub.Info(cpb.InfoRequest()).model_name

        # One request: its prompt's 2 full blocks and the block its first generated tokens filled
        # (10 + 5 tokens computed; the last sampled token never is) are committed, in one chain.
        output = generate(services, PROMPT, 6)
        tokens = PROMPT + output
        wait_until(lambda: len(stored_blocks(subscriber.events(), "GPU")) == 3, 10, "3 blocks stored")
        plain = stored_blocks(subscriber.events(), "GPU")
        assert [b[2] for b in plain] == [tokens[0:4], tokens[4:8], tokens[8:12]]
        assert [b[1] for b in plain] == [None, plain[0][0], plain[1][0]]  # chained: each the next one's parent
        assert {b[3] for b in plain} == {None}  # no cache salt: extra_keys nil, as vLLM sends it
        assert len({b[0] for b in plain}) == 3

        # The same prompt under a cache salt: the same tokens in a namespace of its own, other hashes.
        generate(services, PROMPT, 6, cache_salt="tenant-a")
        wait_until(lambda: len(stored_blocks(subscriber.events(), "GPU")) == 6, 10, "3 more blocks stored")
        salted = stored_blocks(subscriber.events(), "GPU")[3:]
        assert [b[2] for b in salted] == [b[2] for b in plain]
        assert {b[3] for b in salted} == {namespace_key(cache_namespace(model_name, "tenant-a")).hex()}
        assert not {b[0] for b in salted} & {b[0] for b in plain}

        # The tiers copy each committed block: the same hashes, tokens and parents, media CPU and DISK.
        for medium in ("CPU", "DISK"):
            wait_until(lambda m=medium: len(stored_blocks(subscriber.events(), m)) == 6, 30, f"6 blocks in {medium}")
            assert sorted(stored_blocks(subscriber.events(), medium)) == sorted(plain + salted)

        # A request that needs the whole pool evicts every cached block, least recently used first;
        # the host tier keeps its copies.
        long_prompt = [(7 * i) % 250 + 1 for i in range(100)]
        generate(services, long_prompt, NUM_POOL_BLOCKS * BLOCK_SIZE - len(long_prompt))
        wait_until(lambda: sum(len(e["block_hashes"]) for e in subscriber.events()
                               if e["type"] == "BlockRemoved" and e["medium"] == "GPU") == 6, 10, "6 blocks evicted")
        removed = [h for e in subscriber.events() if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert sorted(removed) == sorted(b[0] for b in plain + salted)
        assert not [e for e in subscriber.events() if e["type"] == "BlockRemoved" and e["medium"] != "GPU"]

        # What a router rebuilds from the events is what the memory service says it holds.
        def rebuilt_matches_stats() -> bool:
            stats, held = services.memory_stats(), holdings(subscriber.events())
            host, disk = stats.tiers  # fastest first
            return (len(held.get("GPU", ())) == sum(p.num_cached_blocks for p in stats.pools)
                    and len(held.get("CPU", ())) == host.num_blocks and len(held.get("DISK", ())) == disk.num_blocks)

        services.wait_released()
        wait_until(rebuilt_matches_stats, 30, "the events' holdings to match Stats", interval_s=0.1)
        assert len(holdings(subscriber.events())["GPU"]) == 31  # the long request's full blocks (127 tokens computed)
        seqs = sorted(subscriber.batches)
        assert seqs == list(range(len(seqs)))  # no gap left: received, or replayed
        assert subscriber.num_received > 0  # the PUB socket delivers, beside the replay
        assert all(isinstance(b[0], float) and abs(b[0] - time.time()) < 120 and b[2] == 0
                   for b in subscriber.batches.values())


def test_a_full_log_drops_its_backlog_and_clears() -> None:
    """The publisher's backlog is bounded: a Step never waits for a subscriber (the drops are counted
    and exported as pagedserve_memory_kv_events_dropped_total); past the bound everything pending is
    void, and consumers are told to start over."""
    log = KvEventLog(block_size=BLOCK_SIZE, max_pending_records=4)
    ns_key = namespace_key(cache_namespace("m", ""))
    log.note_namespaces([cache_namespace("m", "")])  # 1 change
    log.pool_stored([(i + 1, (i, encode_token_ids([i] * BLOCK_SIZE), ns_key), None) for i in range(3)])  # 3 more
    [stored] = log.take(timeout_s=0)
    assert stored.token_ids == [0] * 4 + [1] * 4 + [2] * 4 and stored.parent_block_hash is None
    assert stored.namespace is None and "extra_keys" not in encode_event(stored)  # no cache salt: vLLM's default
    log.pool_removed([3])
    log.pool_removed([1, 2])  # 3 pending
    log.pool_stored([(4, (0, encode_token_ids([5] * BLOCK_SIZE), ns_key), None),
                     (6, (4, encode_token_ids([6] * BLOCK_SIZE), ns_key), None)])  # past 4: all 5 dropped
    log.pool_stored([(5, (0, encode_token_ids([7] * BLOCK_SIZE), ns_key), None)])  # a root: known
    assert log.num_dropped_events == 5
    cleared, root = log.take(timeout_s=0)
    assert type(cleared) is AllBlocksCleared and root.parent_block_hash is None and root.token_ids == [7] * 4
    log.pool_removed([1, 2, 3])  # forgotten at the clear: nothing to say
    assert (log.num_events, log.take(timeout_s=0)) == (3, [])


def test_a_block_whose_parent_was_dropped_is_never_announced_as_a_first_block() -> None:
    """A child of a dropped store, announced with parent None, would index a false prefix; a dropped
    removal would leave its block in the resolver (and in consumers) for good; namespaces count."""
    log = KvEventLog(block_size=2, max_pending_records=1)
    ns_key = namespace_key(cache_namespace("m", "s"))
    log.pool_stored([(1, (0, encode_token_ids([1, 2]), ns_key), None)])  # A (a root)
    log.pool_stored([(2, (1, encode_token_ids([3, 4]), ns_key), None)])  # B, child of A: past the bound
    assert [type(e) for e in log.take(timeout_s=0)] == [AllBlocksCleared]
    log.pool_stored([(3, (2, encode_token_ids([5, 6]), ns_key), None)])  # C, child of the dropped B
    assert log.take(timeout_s=0) == [] and log.num_dropped_events == 3  # A and B, then C unannounced
    log.pool_stored([(4, (0, encode_token_ids([1, 2]), ns_key), None)])  # A again, stored anew
    [a] = log.take(timeout_s=0)
    log.pool_stored([(5, (4, encode_token_ids([3, 4]), ns_key), None)])
    [b] = log.take(timeout_s=0)
    assert (b.parent_block_hash, b.token_ids) == (a.block_hashes[0], [3, 4])
    log.pool_removed([4])
    log.pool_removed([5])  # dropped: the log forgets the pool, so nothing stays behind
    assert [type(e) for e in log.take(timeout_s=0)] == [AllBlocksCleared]
    assert log._pool == {}
    for _ in range(3):
        log.note_namespaces([cache_namespace("m", "s")] * 1000)  # past the bound too
    assert len(log._records) == 1 and log.num_dropped_events == 3 + 2 + 3000


def test_blocks_a_tier_found_at_a_start_are_announced_in_chains_after_the_clear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier's blocks from before a restart, parents first: one event per chain (bounded), the
    hashes the pool gives the same content, a block whose parent is unknown never announced, and a
    found block's eviction announced too."""
    monkeypatch.setattr(log_module, "MAX_FOUND_RUN_BLOCKS", 2)
    log = KvEventLog(block_size=2)
    log.set_tier_capacity(100)
    log.cleared()
    ns_key = namespace_key(cache_namespace("m", "s"))
    tokens = [encode_token_ids([i, i]) for i in range(4)]
    log.tier_found("DISK", [(b"a", ns_key, None, tokens[0]), (b"b", ns_key, b"a", tokens[1]),
                            (b"c", ns_key, b"b", tokens[2]), (b"d", ns_key, b"gone", tokens[3])])
    cleared, first, second = log.take(timeout_s=0)
    assert type(cleared) is AllBlocksCleared
    assert (first.medium, first.token_ids, first.parent_block_hash, first.namespace) == (
        "DISK", [0, 0, 1, 1], None, ns_key.hex())  # a namespace not named yet counts as salted
    assert (second.token_ids, second.parent_block_hash) == ([2, 2], first.block_hashes[-1])
    assert log.num_dropped_events == 1  # d: its parent is unknown
    log.pool_stored([(1, (ROOT_ENTRY_ID, tokens[0], ns_key), b"a"), (2, (1, tokens[1], ns_key), b"b")])
    [pool] = log.take(timeout_s=0)
    assert (pool.medium, pool.block_hashes) == ("GPU", first.block_hashes)  # one content, one hash
    log.tier_changed("DISK", b"c", False)
    assert log.take(timeout_s=0) == [BlockRemoved(second.block_hashes, "DISK")]


def replayed_seqs(tmp_path: Path, num_batches: int) -> list[int]:
    """The sequence numbers a replay from 0 returns after ``num_batches`` batches of one
    ``AllBlocksCleared`` each, read by a client slower than the replay; fails without the end marker."""
    log = KvEventLog(block_size=BLOCK_SIZE)
    for _ in range(num_batches - 1):
        log.cleared()
    publisher = KvEventPublisher(log, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "t")
    publisher.start()  # its own AllBlocksCleared is the last
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    try:
        wait_until(lambda: publisher.num_batches == num_batches, 30, "the batches sent", interval_s=0.05)
        client.connect(f"ipc://{tmp_path}/replay")
        client.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(1.0)  # the client reads only once the whole replay is queued
        seqs = []
        while True:
            assert client.poll(10_000), f"the replay stopped after {len(seqs)} batches, without its end marker"
            _, _, seq, payload = client.recv_multipart()
            if seq == END_OF_REPLAY:
                return seqs
            seqs.append(int.from_bytes(seq, "big"))
            assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        client.close(0)
        context.term()
        publisher.close()


def test_a_replay_longer_than_zmqs_default_send_limit_arrives_whole(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ZMQ's default send limit (1,000 messages per peer) must not cut a replay: every buffered batch
    comes back, then the end marker."""
    monkeypatch.setattr(publisher_module, "MAX_EVENTS_PER_BATCH", 1)  # one batch per event
    assert replayed_seqs(tmp_path, 5_000) == list(range(5_000))


def test_the_replay_buffer_is_bounded_by_bytes_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publisher_module, "MAX_EVENTS_PER_BATCH", 1)
    num_payload_bytes = len(msgpack.packb([time.time(), [{"type": "AllBlocksCleared"}], 0]))  # the same for each batch
    monkeypatch.setattr(publisher_module, "REPLAY_BUFFER_BYTES", 10 * num_payload_bytes + num_payload_bytes // 2)
    assert replayed_seqs(tmp_path, 50) == list(range(40, 50))  # the 10 newest


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", "http://host:5557"])
def test_a_kv_events_endpoint_must_be_a_zmq_address(endpoint: str) -> None:
    with pytest.raises(ValueError, match="kv_events_endpoint must be a ZMQ address"):
        MemoryServiceConfig(kv_events_endpoint=endpoint)
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        MemoryServiceConfig(kv_events_replay_endpoint="tcp://*:5558")
