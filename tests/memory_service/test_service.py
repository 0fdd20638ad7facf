"""The memory service over the wire: a real server process, clients in other processes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from memory_service.api import AllocateOp, AppendOp, ForkOp, FreeOp, MemoryClient
from pagedserve.memory.v1 import memory_pb2 as pb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.process import wait_until
from pagedserve.stack import shm_segments
from pagedserve.test_hooks import TEST_HOOKS_ENV, encode_test_hooks
from tests.memory_service.conftest import TINY_LAYOUT, start_memory_service

ROOT = Path(__file__).resolve().parents[2]


def stub_for(socket: str) -> memory_pb2_grpc.MemoryManagerStub:
    return memory_pb2_grpc.MemoryManagerStub(grpc.insecure_channel(f"unix:{socket}"))


def used_blocks(client: MemoryClient) -> int:
    return sum(p.num_used_blocks for p in client.stats().pools)


def test_socket_is_private(memory_service: str) -> None:
    assert stat.S_IMODE(os.stat(memory_service).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(memory_service)).st_mode) == 0o700


def test_health_and_reflection(memory_service: str) -> None:
    channel = grpc.insecure_channel(f"unix:{memory_service}")
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="pagedserve.memory.v1.MemoryManager"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in next(replies).list_services_response.service}
    assert {"pagedserve.memory.v1.MemoryManager", "grpc.health.v1.Health"} <= names


def test_step_allocates_shares_prefix_and_frees(memory_service: str) -> None:
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "t") as client:
        assert client.pool.shape == (2, 2, 16, 4, 2, 4)
        prompt = list(range(10))  # 2 full blocks + 2 tokens
        [a] = client.step([AllocateOp("a", prompt, max_num_new_tokens=100)])
        assert a.ok and a.num_cached_tokens == 0 and a.num_new_tokens == 10 and len(a.block_ids) == 3
        [b] = client.step([AllocateOp("b", prompt, max_num_new_tokens=100)])
        assert b.ok and b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
        assert b.block_ids[2] != a.block_ids[2]
        results = client.step([AppendOp("a", [10, 11, 12]), ForkOp("a", "a2"), FreeOp("b")])
        assert [r.ok for r in results] == [True, True, True]
        assert client.block_table("a2") == client.block_table("a")
        stats = client.stats()
        assert stats.num_sequences == 2 and stats.prefix_cache_hits == 8


def test_clients_of_one_service_are_told_the_same_identity(memory_service: str) -> None:
    with (MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "a") as a,
          MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "b") as b):
        assert a.memory_service_id == b.memory_service_id
        assert a.memory_service_id.startswith("ms-") and len(a.memory_service_id) == 35
        assert a.tiers == b.tiers == ()  # no tier configured


def test_out_of_blocks_is_a_result_not_an_error(memory_service: str) -> None:
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "t") as client:
        # 12 general blocks hold 48 tokens; priority 0 cannot take the 4 reserved ones.
        [big] = client.step([AllocateOp("big", list(range(48)), max_num_new_tokens=48)])
        assert big.ok
        results = client.step([AllocateOp("low", [1, 2, 3], 3), AllocateOp("high", [1, 2, 3], 3, priority=1)])
        assert [r.ok for r in results] == [False, True]
        assert results[1].block_ids[0] >= 12  # from the reserved pool
        with pytest.raises(ValueError, match="low|not a live"):
            try:
                client.block_table("low")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                raise ValueError(exc.details()) from None


@pytest.mark.parametrize(
    ("ops", "needle"),
    [
        ([pb.SequenceOp(append=pb.AppendOp(seq_id="nope", token_ids=[1]))], "nope"),
        ([pb.SequenceOp(free=pb.FreeOp(seq_id="nope"))], "nope"),
        ([pb.SequenceOp(fork=pb.ForkOp(parent_seq_id="ghost", child_seq_id="c"))], "ghost"),
        ([pb.SequenceOp(allocate=pb.AllocateOp(seq_id="x", prompt_token_ids=[1], max_num_new_tokens=-5))],
         "max_num_new_tokens"),
        ([pb.SequenceOp(allocate=pb.AllocateOp(seq_id="x", prompt_token_ids=[-1], max_num_new_tokens=1))], "token"),
        ([pb.SequenceOp(allocate=pb.AllocateOp(seq_id="x", prompt_token_ids=[1] * 100000, max_num_new_tokens=1))], ""),
        ([pb.SequenceOp()], "SequenceOp"),
    ],
)
def test_bad_input_is_invalid_argument_and_changes_nothing(memory_service: str, ops: list, needle: str) -> None:
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "t") as client:
        [ok] = client.step([AllocateOp("keep", [5, 6, 7, 8, 9], 5)])
        before = client.stats()
        stub = stub_for(memory_service)
        # A valid op in front of the bad one must not be applied either.
        request = pb.StepRequest(client_id=client.client_id, ops=[pb.SequenceOp(free=pb.FreeOp(seq_id="keep")), *ops])
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details()
        assert client.stats() == before
        assert client.block_table("keep") == ok.block_ids


def test_unknown_client_and_bad_layout(memory_service: str) -> None:
    stub = stub_for(memory_service)
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(pb.StepRequest(client_id="who", ops=[]))
    # Not attached (never, or the lease is gone): the client must attach again.
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "who" in info.value.details()
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "t"):
        other = pb.KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)
        with pytest.raises(grpc.RpcError) as info:
            stub.Attach(pb.AttachRequest(client_name="x", layout=other))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:
        stub.Attach(pb.AttachRequest(client_name="x",
                                     layout=pb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="int8")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in info.value.details()
    assert stub.Ping(pb.PingRequest()) == pb.PingResponse()  # still serving


WRITER = """
import sys, torch
from memory_service.api import AllocateOp, KvLayout, MemoryClient
layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)
client = MemoryClient("unix:" + sys.argv[1], layout, "writer")
[r] = client.step([AllocateOp("w", list(range(8)), 8, namespace=sys.argv[3] if len(sys.argv) > 3 else "")])
block = r.block_ids[1]
client.pool[1, 0, block] = torch.arange(32, dtype=torch.float32).view(4, 2, 4)  # layer 1, K
if "uncommitted" not in sys.argv[2]:
    client.commit()
print(block, flush=True)
if sys.argv[2].startswith("hang"):
    sys.stdin.read()
client.close() if sys.argv[2] == "close" else None
"""


def test_another_process_writes_the_same_bytes(memory_service: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WRITER, memory_service, "stay"], capture_output=True, text=True, check=True, cwd=ROOT
    )
    block = int(out.stdout.split()[0])
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "reader") as reader:
        expected = torch.arange(32, dtype=torch.float32).view(4, 2, 4)
        assert torch.equal(reader.pool[1, 0, block], expected)


def test_copy_on_write_copies_every_layer_without_torch_in_the_service() -> None:
    """The service copies a shared block's bytes (every layer's K and V) without importing torch:
    the CPU pool is plain bytes to it, and torch costs seconds of CPU at every start. Before:
    ``kv_pool`` imported torch."""
    service, socket = start_memory_service("--max-num-blocks", "16")
    try:
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, "cow") as client:
            [a] = client.step([AllocateOp("a", list(range(6)), max_num_new_tokens=8)])  # 4 + 2 tokens
            shared = a.block_ids[1]
            torch.manual_seed(0)
            client.pool[:, :, shared] = torch.randn(client.pool[:, :, shared].shape)
            before = client.pool.clone()
            client.step([ForkOp("a", "b")])
            [append] = client.step([AppendOp("a", [6])])  # a writes into the block b also holds
            [(src, dst)] = append.copies
            assert src == shared and torch.equal(client.pool[:, :, dst], before[:, :, shared])
            others = [i for i in range(client.pool.shape[2]) if i != dst]
            assert torch.equal(client.pool[:, :, others], before[:, :, others])  # nothing else written
        maps = Path(f"/proc/{service.pid}/maps").read_text()
        assert "libtorch" not in maps
    finally:
        assert service.stop() == 0


def test_killed_client_gets_its_blocks_reclaimed(memory_service: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, memory_service, "hang"], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
        text=True, cwd=ROOT,
    )
    int(proc.stdout.readline())
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "observer") as observer:
        assert used_blocks(observer) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: used_blocks(observer) == 0, 10, "the killed writer's blocks released")
        assert observer.stats().num_clients == 1
        # The writer committed its full blocks: they stay cached for the next identical prompt.
        [r] = observer.step([AllocateOp("again", list(range(8)) + [99], 9)])
        assert r.num_cached_tokens == 8


def test_blocks_of_a_writer_killed_before_committing_are_never_shared(memory_service: str) -> None:
    """Over the wire: the writer dies before its next step, so its blocks never become cache hits,
    in its namespace or any other."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, memory_service, "hang-uncommitted", "m|public"],
        stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, cwd=ROOT,
    )
    int(proc.stdout.readline())
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "reader") as reader:
        [early] = reader.step([AllocateOp("r1", list(range(8)) + [99], 9, namespace="m|public")])
        assert early.num_cached_tokens == 0  # not committed yet: not shared
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: reader.stats().num_clients == 1, 10, "the killed writer detached")
        [late] = reader.step([AllocateOp("r2", list(range(8)) + [99], 9, namespace="m|public")])
        assert late.num_cached_tokens == 0


def test_lease_expires_without_keepalive(memory_service: str) -> None:
    stub = stub_for(memory_service)
    layout = pb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)
    reply = stub.Attach(pb.AttachRequest(client_name="silent", layout=layout))
    allocate = pb.AllocateOp(seq_id="s", prompt_token_ids=[1, 2], max_num_new_tokens=2)
    stub.Step(pb.StepRequest(client_id=reply.client_id, ops=[pb.SequenceOp(allocate=allocate)]))
    assert sum(p.num_used_blocks for p in stub.Stats(pb.StatsRequest()).pools) == 1
    # The TTL is 2 s; the reaper may run late on a loaded machine.
    wait_until(lambda: sum(p.num_used_blocks for p in stub.Stats(pb.StatsRequest()).pools) == 0, 15,
               "the silent client's lease expired")
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(pb.StepRequest(client_id=reply.client_id, ops=[]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_prometheus_metrics() -> None:
    import socket as socketlib
    import urllib.request

    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service, sock = start_memory_service("--max-num-blocks", "16", "--metrics-port", str(port))
    try:
        with MemoryClient(f"unix:{sock}", TINY_LAYOUT, "m") as client:
            client.step([AllocateOp("a", list(range(9)), 9)])
            bodies: list[str] = []

            def scraped() -> bool:
                try:
                    bodies.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
                except OSError:
                    return False
                return True

            wait_until(scraped, 10, "the metrics endpoint answering", interval_s=0.1)
            [body] = bodies
        assert 'pagedserve_memory_blocks{pool="general",state="used"} 3.0' in body
        assert 'pagedserve_memory_blocks{pool="general",state="total"} 16.0' in body
        assert "pagedserve_memory_kv_utilization 0.75" in body
        # No authentication, so it listens on loopback only (it once listened on 0.0.0.0).
        listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                     if line.split()[3] == "0A"]
        assert f"0100007F:{port:04X}" in listening and f"00000000:{port:04X}" not in listening
    finally:
        service.stop()


def test_integrity_check_over_the_wire(memory_service: str) -> None:
    """CheckIntegrity answers ok before any attach, with live sequences, and after they are freed."""
    stub = stub_for(memory_service)
    assert stub.CheckIntegrity(pb.CheckIntegrityRequest()).ok
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "t") as client:
        client.step([AllocateOp("a", list(range(10)), max_num_new_tokens=100)])
        client.step([ForkOp("a", "b"), AppendOp("b", [1, 2, 3])])
        assert client.check_integrity() is None
        client.step([FreeOp("a"), FreeOp("b")])
        assert client.check_integrity() is None
    reply = stub.CheckIntegrity(pb.CheckIntegrityRequest())
    assert reply.ok and reply.problem == ""


def test_integrity_check_reports_a_broken_invariant() -> None:
    """A corrupted reference count (a bug) is reported with the invariant it breaks, not hidden."""
    import asyncio

    from memory_service.config import MemoryServiceConfig
    from memory_service.service.servicer import MemoryManagerServicer

    async def scenario() -> tuple[str | None, str | None]:
        servicer = MemoryManagerServicer(MemoryServiceConfig(max_num_blocks=16, block_size=4))
        try:
            attached = await servicer.Attach(pb.AttachRequest(client_name="t", layout=pb.KvLayout(
                num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)), None)
            assert attached.client_id
            before = servicer.check_integrity()
            servicer.block_manager._pool.ref_counts[3] += 1  # a block held by no table
            return before, servicer.check_integrity()
        finally:
            await servicer.close()

    before, after = asyncio.run(scenario())
    assert before is None
    assert after == "block 3: refcount 1 but 0 tables hold it"


LAYOUT = pb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def _start_with_slow_creation(monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple:
    """A service whose pool takes 3 s to create once its segment exists (the test-only delay), as a
    big pool does (~2.5 s a GiB here), whatever this machine's speed."""
    monkeypatch.setenv(TEST_HOOKS_ENV, encode_test_hooks(pool_creation_delay_s=3))
    return start_memory_service("--max-num-blocks", "16", *extra)


def _attach_in_background(socket: str, timeout_s: float = 120) -> tuple[threading.Thread, list]:
    """The first Attach, from another thread: it waits for the pool's creation."""
    outcome: list = []

    def attach() -> None:
        try:
            request = pb.AttachRequest(client_name="first", layout=LAYOUT)
            outcome.append(stub_for(socket).Attach(request, timeout=timeout_s))
        except grpc.RpcError as exc:
            outcome.append(exc.code())

    thread = threading.Thread(target=attach)
    thread.start()
    return thread, outcome


def test_calls_are_answered_while_the_first_attach_creates_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool is created in a worker thread: health and Stats are answered while the first Attach
    is still waiting for it (Stats says so: no client yet, no blocks). When the creation ran on the
    event loop, every call waited for it, and Stats saw the attached client."""
    service, socket = _start_with_slow_creation(monkeypatch)
    try:
        thread, outcome = _attach_in_background(socket)
        wait_until(lambda: shm_segments(service.pid), 30, "the pool's segment created")
        channel = grpc.insecure_channel(f"unix:{socket}")
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pagedserve.memory.v1.MemoryManager"), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stats = stub_for(socket).Stats(pb.StatsRequest(), timeout=30)
        assert stats.num_clients == 0 and sum(p.num_total_blocks for p in stats.pools) == 0
        thread.join(120)
        [reply] = outcome
        assert reply.num_blocks == 16
        stats = stub_for(socket).Stats(pb.StatsRequest(), timeout=30)
        assert stats.num_clients == 1 and sum(p.num_total_blocks for p in stats.pools) == reply.num_blocks
        stub_for(socket).Detach(pb.DetachRequest(client_id=reply.client_id), timeout=30)
    finally:
        assert service.stop() == 0
    assert shm_segments(service.pid) == []


def test_stopped_while_creating_the_pool_leaves_no_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM mid-creation: the service waits for the worker thread, frees the pool, and the waiting
    Attach is answered UNAVAILABLE (no client attached to a pool that is going away)."""
    service, socket = _start_with_slow_creation(monkeypatch)
    thread, outcome = _attach_in_background(socket)
    wait_until(lambda: shm_segments(service.pid), 30, "the pool's segment created")
    assert service.stop(timeout_s=60) == 0
    thread.join(60)
    assert shm_segments(service.pid) == []
    assert outcome == [grpc.StatusCode.UNAVAILABLE]


def test_attaches_that_wait_for_the_pool_together_keep_to_max_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two first attaches at once, one client allowed: both wait for the pool, then exactly one gets a
    lease and the other RESOURCE_EXHAUSTED (the limit is checked after the wait, not before it)."""
    service, socket = _start_with_slow_creation(monkeypatch, "--max-clients", "1")
    try:
        attaches = [_attach_in_background(socket) for _ in range(2)]
        for thread, _ in attaches:
            thread.join(120)
        outcomes = [outcome for _, [outcome] in attaches]
        assert sorted(isinstance(o, pb.AttachResponse) for o in outcomes) == [False, True]
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in outcomes
        assert stub_for(socket).Stats(pb.StatsRequest(), timeout=30).num_clients == 1
    finally:
        assert service.stop() == 0
    assert shm_segments(service.pid) == []


def test_an_attach_that_gives_up_mid_creation_leaves_one_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first Attach's deadline passes while the pool is created (its handler is cancelled, the
    creation goes on); the next Attach waits for that creation instead of starting a second pool,
    which would have replaced the first and left its segment in /dev/shm."""
    service, socket = _start_with_slow_creation(monkeypatch)
    try:
        impatient, gave_up = _attach_in_background(socket, timeout_s=0.5)
        impatient.join(60)
        assert gave_up == [grpc.StatusCode.DEADLINE_EXCEEDED]
        patient, outcome = _attach_in_background(socket)
        patient.join(120)
        [reply] = outcome
        assert len(shm_segments(service.pid)) == 1
        assert stub_for(socket).Stats(pb.StatsRequest(), timeout=30).num_clients == 1
        stub_for(socket).Detach(pb.DetachRequest(client_id=reply.client_id), timeout=30)
    finally:
        assert service.stop() == 0
    assert shm_segments(service.pid) == []
