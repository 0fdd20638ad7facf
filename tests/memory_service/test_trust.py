"""The memory service's token, against a real memory service process: a client
without it cannot name another tenant's cache namespace (PERMISSION_DENIED, nothing applied), is
confined to a namespace of its own and to its block quota, cannot act under a trusted client's id;
TCP without a token is refused at start. Each test failed on the old code (its docstring says how).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from memory_service import __main__ as memory_main
from memory_service.api import AllocateOp, AppendOp, FreeOp, MemoryClient, cache_namespace
from memory_service.config import MemoryServiceConfig
from pagedserve.memory.v1 import memory_pb2 as pb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.service_auth import MEMORY_TOKEN_ENV
from pagedserve.stack import shm_segments
from tests.memory_service.conftest import TINY_LAYOUT, start_memory_service

TOKEN = "memory-token-0123456789abcdef"
VICTIM = cache_namespace("model", "tenant-b")  # a namespace a compute service would use


@pytest.fixture
def guarded(tmp_path: Path):
    """A 16-block service (block size 4) with a token: untrusted clients get 3 blocks, trusted 6."""
    token_file = tmp_path / "memory.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    service, socket = start_memory_service("--max-num-blocks", "16", "--auth-token-file", str(token_file),
                                           "--max-untrusted-client-blocks", "3", "--max-blocks-per-client", "6")
    yield f"unix:{socket}"
    assert service.stop() == 0
    assert shm_segments(service.pid) == []


def test_untrusted_client_cannot_commit_under_another_namespace(guarded: str) -> None:
    """Before: the foreign client's blocks were committed under VICTIM, and the victim's allocation
    of the same prompt came back with 8 cached (never written) tokens."""
    prompt = list(range(1, 10))  # 2 full blocks and 1 token
    with MemoryClient(guarded, TINY_LAYOUT, client_name="foreign") as foreign, \
            MemoryClient(guarded, TINY_LAYOUT, client_name="compute", token=TOKEN) as victim:
        with pytest.raises(grpc.RpcError) as info:
            foreign.step([AllocateOp("evil", prompt, 16, namespace=VICTIM)])
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "ops[0].namespace" in info.value.details()
        assert foreign.stats().num_sequences == 0  # the whole step refused, nothing applied
        # Its default namespace is its own: committed, yet nobody else's prompt hits it.
        [own] = foreign.step([AllocateOp("own", prompt, 16)])
        assert own.ok and len(own.block_ids) == 3
        foreign.commit()
        for namespace in (VICTIM, ""):
            [hit] = victim.step([AllocateOp(f"v{namespace!r}", prompt, 16, namespace=namespace)])
            assert hit.ok and hit.num_cached_tokens == 0
        # The trusted client's own namespace still works as before: a second sequence hits.
        victim.commit()
        [_, again] = victim.step([FreeOp("v''"), AllocateOp("again", prompt, 16, namespace=VICTIM)])
        assert again.num_cached_tokens == 8
        assert victim.check_integrity() is None


def test_untrusted_client_holds_at_most_its_quota(guarded: str) -> None:
    """Before: one client took all 16 blocks (the review's 8192 of 8192)."""
    with MemoryClient(guarded, TINY_LAYOUT, client_name="foreign") as foreign:
        step = foreign.step_with_counts([AllocateOp("a", list(range(12)), 12)])
        assert [r.ok for r in step.results] == [True] and len(step.results[0].block_ids) == 3
        assert step.num_available_blocks == 0  # what it may still take: its quota, not the pool's 13
        assert foreign.step([AllocateOp("b", [1], 1)])[0].ok is False
        assert foreign.step([AppendOp("a", [7])])[0].ok is False
        foreign.step([FreeOp("a")])
        assert foreign.step([AllocateOp("b", list(range(9)), 9)])[0].ok
    with MemoryClient(guarded, TINY_LAYOUT, client_name="compute", token=TOKEN) as trusted:
        assert trusted.step([AllocateOp("a", list(range(24)), 24)])[0].ok  # 6 blocks: its cap
        assert trusted.step([AllocateOp("b", [1], 1)])[0].ok is False
        assert trusted.stats().pools[0].num_used_blocks == 6


def test_a_trusted_clients_id_needs_the_token(guarded: str) -> None:
    """Before: any caller that knew a client id could step, read or detach it."""
    with MemoryClient(guarded, TINY_LAYOUT, client_name="compute", token=TOKEN) as trusted:
        channel = grpc.insecure_channel(guarded)
        stub = memory_pb2_grpc.MemoryManagerStub(channel)
        for call, request in [
            (stub.Step, pb.StepRequest(client_id=trusted.client_id)),
            (stub.Detach, pb.DetachRequest(client_id=trusted.client_id)),
            (stub.GetBlockTable, pb.GetBlockTableRequest(client_id=trusted.client_id, seq_id="x")),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=5, metadata=(("authorization", "Bearer wrong-token-0123456789"),))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        assert trusted.step([AllocateOp("a", [1, 2], 2)])[0].ok  # still attached, untouched
        assert trusted.stats().num_clients == 1


def test_tcp_without_a_token_is_refused_at_start(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    """Before: ``--address 0.0.0.0:PORT`` served block allocation to the network, unauthenticated."""
    monkeypatch.delenv(MEMORY_TOKEN_ENV, raising=False)
    assert memory_main.main(["--address", "127.0.0.1:0"]) == 2
    assert "needs a token" in capsys.readouterr().err
    monkeypatch.setenv(MEMORY_TOKEN_ENV, TOKEN)
    config = MemoryServiceConfig(address="127.0.0.1:0")
    assert config.auth_token == TOKEN and TOKEN not in repr(config)
