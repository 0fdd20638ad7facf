"""The memory service's hardening, against a real memory service process: bounded streams, leases
that survive a transient stream end, isolation between clients, safe sockets and pool sizes, a
private service tied to its owner, bugs answered INTERNAL. Each test failed before its fix (its
docstring notes the old behaviour).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from memory_service.api import AllocateOp, MemoryClient, MemoryServiceUnavailable
from pagedserve.memory.v1 import memory_pb2 as pb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.process import wait_until
from pagedserve.stack import shm_segments
from tests.memory_service.conftest import TINY_LAYOUT, start_memory_service
from tests.processes import is_gone

TINY_PB = pb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def stub_for(socket: str) -> memory_pb2_grpc.MemoryManagerStub:
    return memory_pb2_grpc.MemoryManagerStub(grpc.insecure_channel(f"unix:{socket}"))


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code()


def test_streams_cost_no_thread_and_are_bounded_per_client(memory_service: str) -> None:
    """Before: 16 KeepAlive streams took all 16 worker threads; Ping, Stats and Attach timed out."""
    stub = stub_for(memory_service)
    client_ids = [stub.Attach(pb.AttachRequest(client_name=f"c{i}", layout=TINY_PB)).client_id for i in range(6)]
    streams = [stub.KeepAlive(pb.KeepAliveRequest(client_id=c, interval_s=0.5)) for c in client_ids for _ in range(4)]
    for stream in streams:  # 24 open streams, each has sent its first heartbeat
        next(stream)
    stub.Ping(pb.PingRequest(), timeout=3)
    assert stub.Stats(pb.StatsRequest(), timeout=3).num_clients == 6
    stub.Attach(pb.AttachRequest(client_name="late", layout=TINY_PB), timeout=3)
    # A fifth stream of one client is refused; its four others keep going.
    fifth = stub.KeepAlive(pb.KeepAliveRequest(client_id=client_ids[0]))
    assert code_of(next, fifth) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert next(streams[0]).server_time > 0
    for stream in streams:
        stream.cancel()


@pytest.mark.parametrize("interval_s", [float("inf"), 1e13, float("nan"), 1e-9, -1.0])
def test_keepalive_interval_is_validated(memory_service: str, interval_s: float) -> None:
    """Before: inf/1e13 raised OverflowError (UNKNOWN) and dropped the lease; nan/1e-9 busy-looped."""
    stub = stub_for(memory_service)
    client_id = stub.Attach(pb.AttachRequest(client_name="k", layout=TINY_PB)).client_id
    with pytest.raises(grpc.RpcError) as info:
        next(stub.KeepAlive(pb.KeepAliveRequest(client_id=client_id, interval_s=interval_s)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "interval_s" in info.value.details()
    stub.Step(pb.StepRequest(client_id=client_id))  # the lease survived


def test_transient_stream_end_keeps_the_lease_and_the_client_reopens(memory_service: str) -> None:
    """Before: any end of the KeepAlive stream freed all of the client's sequences at once, and
    MemoryClient never reopened it. Now the TTL (2 s here) starts, and the client reopens."""
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "t") as client:
        [r] = client.step([AllocateOp("a", [1, 2, 3], 3)])
        # The stream is opened by the client's keep-alive thread: cancel it once it is open.
        wait_until(lambda: client._keepalive_call is not None, 10, "the keep-alive stream open")
        client._keepalive_call.cancel()  # a transient end of the stream
        time.sleep(3.0)  # outlasting the 2 s TTL is the point: only a reopened stream keeps the lease
        assert client.is_connected
        assert client.block_table("a") == r.block_ids
    # A raw stream that ends is not an instant release either: the TTL runs from its end.
    stub = stub_for(memory_service)
    client_id = stub.Attach(pb.AttachRequest(client_name="raw", layout=TINY_PB)).client_id
    stream = stub.KeepAlive(pb.KeepAliveRequest(client_id=client_id))
    next(stream)
    stub.Step(pb.StepRequest(client_id=client_id, ops=[pb.SequenceOp(allocate=pb.AllocateOp(
        seq_id="s", prompt_token_ids=[1], max_num_new_tokens=1))]))
    stream.cancel()
    time.sleep(0.3)  # well inside the TTL: the sequence must still be there
    assert stub.Stats(pb.StatsRequest()).num_sequences == 1
    wait_until(lambda: stub.Stats(pb.StatsRequest()).num_sequences == 0, 10, "the lease expired")


def test_another_clients_sequence_reads_as_absent(memory_service: str) -> None:
    """Before: GetBlockTable returned another client's table; errors told whether its id existed."""
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "a") as a, \
            MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "b") as b:
        a.step([AllocateOp("secret", [1, 2, 3], 3)])
        details = []
        for seq_id in ("secret", "absent"):
            with pytest.raises(grpc.RpcError) as info:
                b.block_table(seq_id)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details.append(info.value.details().replace(seq_id, "ID"))
        assert details[0] == details[1]
        [mine] = b.step([AllocateOp("secret", [7, 8], 2)])  # the same id, b's own sequence
        assert b.block_table("secret") == mine.block_ids != a.block_table("secret")


def test_client_learns_that_the_service_is_gone_and_restart_cleans_up() -> None:
    """The owner of a client learns the service died (is_connected, an exception it
    can act on); a restart on the same socket removes the stale socket and the dead service's
    segment, and the old client's lease is gone for good (it must attach again)."""
    service, socket = start_memory_service("--max-num-blocks", "16", "--lease-ttl-s", "2")
    client = MemoryClient(f"unix:{socket}", TINY_LAYOUT, "t", step_timeout_s=5)
    try:
        client.step([AllocateOp("a", [1, 2, 3], 3)])
        [segment] = shm_segments(service.pid)
        service.kill()  # SIGKILL: no chance to unlink the socket or the segment
        assert Path(socket).exists() and segment.exists()
        with pytest.raises(MemoryServiceUnavailable):
            client.step([AllocateOp("b", [1], 1)])
        wait_until(lambda: not client.is_connected, 5, "the client to learn that the service is gone")
        restarted, _ = start_memory_service("--max-num-blocks", "16", socket=socket)
        try:
            assert not segment.exists()  # the dead service's segment was removed at start
            with pytest.raises(MemoryServiceUnavailable, match="attach again|FAILED_PRECONDITION"):
                client.step([AllocateOp("b", [1], 1)])
            with MemoryClient(f"unix:{socket}", TINY_LAYOUT, "new") as fresh:
                assert fresh.is_connected and fresh.step([AllocateOp("b", [1], 1)])[0].ok
        finally:
            assert restarted.stop() == 0
        assert not Path(socket).exists() and shm_segments(restarted.pid) == []
    finally:
        client.close()


def test_socket_path_is_never_clobbered_or_shared(tmp_path: Path) -> None:
    """Before: a regular file at --socket was deleted; a second service on a live socket started
    silently; a world-writable directory was accepted."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    regular = private / "precious.txt"
    regular.write_text("keep me")

    def refused(path: Path) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "memory_service", "--socket", str(path), "--log-level", "warning"],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 1, out.stderr
        return out.stderr

    assert "not a socket" in refused(regular) and regular.read_text() == "keep me"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "world-writable" in refused(shared / "memory.sock")
    service, socket = start_memory_service("--max-num-blocks", "16")
    try:
        assert "already listening" in refused(Path(socket))
        stub_for(socket).Ping(pb.PingRequest(), timeout=5)  # the first one still answers
    finally:
        service.stop()


def test_socket_is_owner_only_from_its_creation(tmp_path: Path) -> None:
    """Before: the socket was 0755 (the umask's) until a chmod after the server started."""
    from pagedserve import sockets

    path = tmp_path / "run" / "s.sock"
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    sockets.bind(server, f"unix:{path}")  # created here, before start and before any chmod
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    server.stop(0)


def test_pool_size_is_checked_against_dev_shm_and_bounded() -> None:
    """Before: a pool larger than free /dev/shm was handed out (SIGBUS when written), and a tiny
    layout turned the byte budget into millions of block records."""
    from memory_service.config import MAX_NUM_BLOCKS
    from memory_service.pool.kv_pool import shm_free_bytes

    service, socket = start_memory_service("--kv-cache-bytes", str(shm_free_bytes() + (1 << 30)))
    try:
        stub = stub_for(socket)
        before = stub.Stats(pb.StatsRequest())  # no pool yet: all zeros, both pools named
        assert [(p.name, p.num_total_blocks) for p in before.pools] == [("general", 0), ("reserved", 0)]
        assert (before.num_clients, before.block_size) == (0, 4)
        huge = pb.KvLayout(num_layers=64, num_kv_heads=64, head_dim=256, dtype="float32", block_size=4)
        with pytest.raises(grpc.RpcError) as info:
            stub.Attach(pb.AttachRequest(client_name="huge", layout=huge))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "/dev/shm" in info.value.details()
        tiny = pb.KvLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", block_size=4)
        reply = stub.Attach(pb.AttachRequest(client_name="tiny", layout=tiny))
        assert reply.num_blocks == MAX_NUM_BLOCKS
    finally:
        service.stop()


def test_close_block_count_cannot_overflow_the_reply() -> None:
    from memory_service.config import MemoryServiceConfig

    with pytest.raises(ValueError, match="max_num_blocks"):
        MemoryServiceConfig(max_num_blocks=2**31)
    with pytest.raises(ValueError, match="lease_ttl_s"):
        MemoryServiceConfig(lease_ttl_s=float("nan"))


OWNER = """
import sys, time
from compute_service.llm import MemoryServiceProcess
from memory_service.config import MemoryServiceConfig
proc = MemoryServiceProcess(MemoryServiceConfig(max_num_blocks=16, block_size=4))
print(proc.process.pid, proc.directory, flush=True)
time.sleep(600)
"""


def test_private_memory_service_dies_with_its_owner() -> None:
    """Before: when the owner of LLM's private memory service was SIGKILLed, the child ran on."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    child_pid, directory = owner.stdout.readline().split()
    owner.kill()
    owner.wait()
    wait_until(lambda: is_gone(int(child_pid)), 10, "the private memory service gone with its owner")
    # The child cleaned up what it owns (its socket); the directory was its SIGKILLed owner's.
    assert not (Path(directory) / "memory.sock").exists()
    shutil.rmtree(directory)


def test_an_owner_that_never_closes_leaves_nothing_when_it_exits() -> None:
    """Before: a script that made an LLM and ended without close() left its /tmp/pagedserve-* directory."""
    script = OWNER.replace("time.sleep(600)", "")
    owner = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, timeout=120, check=True)
    child_pid, directory = owner.stdout.split()
    assert is_gone(int(child_pid))
    assert not Path(directory).exists()


@pytest.mark.parametrize("failure", ["exit", "interrupt"])
def test_failed_or_interrupted_private_start_leaves_nothing(monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """Before: a failed start left the temporary directory; a KeyboardInterrupt orphaned the child."""
    from compute_service.llm import MemoryServiceProcess
    from memory_service.config import MemoryServiceConfig
    from pagedserve.process import ServiceProcess

    made, started = [], []
    real_mkdtemp, real_init = tempfile.mkdtemp, ServiceProcess.__init__

    def mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(ServiceProcess, "__init__", init)
    if failure == "interrupt":
        def interrupted(self, timeout_s: float = 0.0) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(ServiceProcess, "wait_ready", interrupted)
        expected: type[BaseException] = KeyboardInterrupt
        config = MemoryServiceConfig(max_num_blocks=16, block_size=4)
    else:
        # A metrics address no interface has (TEST-NET-3): the service cannot bind it and exits.
        expected = RuntimeError
        config = MemoryServiceConfig(max_num_blocks=16, block_size=4, metrics_host="203.0.113.1", metrics_port=9)
    with pytest.raises(expected):
        MemoryServiceProcess(config)
    [directory] = made
    [child] = started
    assert not Path(directory).exists()
    assert child.returncode is not None  # stopped and reaped, not orphaned


def test_a_bug_answers_internal_and_the_service_keeps_serving(tmp_path: Path, monkeypatch) -> None:
    """Before: an unexpected exception surfaced as UNKNOWN. The service runs in this process here,
    so that a bug can be planted in it."""
    import asyncio
    import threading

    from memory_service.manager.block_manager import BlockManager
    from memory_service.config import MemoryServiceConfig
    from memory_service.service.server import start

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    socket = tmp_path / "run" / "memory.sock"
    config = MemoryServiceConfig(socket=str(socket), max_num_blocks=16, block_size=4, log_level="warning")
    service = asyncio.run_coroutine_threadsafe(start(config), loop).result(30)
    try:
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, "t") as client:
            def broken(self: BlockManager) -> None:
                raise RuntimeError("a planted bug")

            monkeypatch.setattr(BlockManager, "stats", broken)
            with pytest.raises(grpc.RpcError) as info:
                stub_for(str(socket)).Stats(pb.StatsRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.INTERNAL and "RuntimeError" in info.value.details()
            monkeypatch.undo()
            assert client.step([AllocateOp("a", [1, 2], 2)])[0].ok  # still serving
    finally:
        asyncio.run_coroutine_threadsafe(service.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
    assert not socket.exists()


def test_a_huge_id_is_echoed_in_a_short_message(memory_service: str) -> None:
    """Before: a 1e6-character seq_id (or client_id) was echoed whole, and the message overflowed
    gRPC's metadata limit, so the client saw RESOURCE_EXHAUSTED instead of the real status."""
    stub = stub_for(memory_service)
    with MemoryClient(f"unix:{memory_service}", TINY_LAYOUT, "t") as client:
        free = pb.SequenceOp(free=pb.FreeOp(seq_id="s" * 1_000_000))
        for request in (pb.GetBlockTableRequest(client_id=client.client_id, seq_id="s" * 1_000_000),
                        pb.StepRequest(client_id=client.client_id, ops=[free])):
            call = stub.GetBlockTable if isinstance(request, pb.GetBlockTableRequest) else stub.Step
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "..." in info.value.details() and len(info.value.details()) < 200
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(pb.StepRequest(client_id="c" * 1_000_000), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and len(info.value.details()) < 200
