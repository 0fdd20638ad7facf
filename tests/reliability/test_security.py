"""Security of the stack: owner-only sockets and shared memory, API keys compared in constant time
and never logged, no prompt text in any log by default, size limits, cache_salt isolation."""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path
from unittest import mock

import grpc
import pytest

from gateway import auth, tenants
from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve_testing.stack import Stack, start_gateway
from pagedserve.stack import shm_segments


def _request(prompt: str = "hello", max_tokens: int = 2, **fields: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, params=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0), **fields)


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_sockets_and_shared_memory_are_owner_only(stack: Stack) -> None:
    for address in (stack.memory.address, stack.compute.address):
        path = address.removeprefix("unix:")
        assert stat.S_ISSOCK(os.stat(path).st_mode) and _mode(path) == 0o600, (path, oct(_mode(path)))
    segments = shm_segments(stack.memory.pid)
    assert segments
    for name in segments:
        assert _mode(Path("/dev/shm", name)) & 0o077 == 0, (name, oct(_mode(Path("/dev/shm", name))))


def test_api_keys_work_and_never_reach_the_log(stack: Stack) -> None:
    good, wrong = "rel-key-5f0e9a7c1d", "rel-guess-0b8d2e"
    keys = stack.run_dir / "keys.txt"
    keys.write_text(f"{good}\n")
    os.chmod(keys, 0o600)
    guarded = start_gateway([stack.compute.address], stack.run_dir, "--api-keys-file", str(keys),
                            "--log-level", "debug")
    try:
        for metadata in ([], [("authorization", f"Bearer {wrong}")], [("authorization", f"Bearer {good[:-1]}")]):
            with pytest.raises(grpc.RpcError) as info:
                guarded.stub.Generate(_request(), metadata=metadata, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = guarded.stub.Generate(_request(), metadata=[("authorization", f"Bearer {good}")], timeout=30)
        assert reply.usage.completion_tokens == 2
    finally:
        assert guarded.stop() == 0
    log = guarded.log_file.read_text()
    assert "request" in log and good not in log and wrong not in log


def test_key_comparison_is_constant_time() -> None:
    """Every configured key is compared with hmac.compare_digest, whichever one matches (no early
    exit that would tell which key a guess is close to)."""
    keys = ["first-key-aaaa", "second-key-bbbb", "third-key-cccc"]
    registry = tenants.Tenants([tenants.Tenant(f"t{i}", keys=(key,)) for i, key in enumerate(keys)], 8)
    for token in (b"first-key-aaaa", b"nothing-like-it", b""):
        with mock.patch.object(tenants.hmac, "compare_digest", wraps=hmac.compare_digest) as compare:
            registry.identify(auth.bearer_token([("authorization", f"Bearer {token.decode()}")]))
        assert compare.call_count == len(keys)


def test_no_prompt_text_in_any_log(stack: Stack, service_model) -> None:
    secret = "my bank password is hunter2-7731"
    stack.gateway.stub.Generate(_request(secret), timeout=30)
    list(stack.gateway.stub.GenerateStream(_request(max_tokens=2, prompt="x" + secret), timeout=30))
    stack.gateway.stub.Generate(gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(
        role="user", content=secret)], params=gateway_pb2.SamplingParams(max_tokens=2)), timeout=30)
    ids = service_model.tokenizer.encode(secret, add_special_tokens=False)
    id_text = ", ".join(map(str, ids[:8]))
    logs = list(stack.run_dir.glob("*.log"))
    assert {p.name.split("-")[0].removesuffix(".log") for p in logs} >= {"memory", "compute", "gateway"}
    for path in logs:
        text = path.read_text(errors="replace")
        assert secret not in text and "hunter2" not in text, f"prompt text in {path.name}"
        assert id_text not in text, f"prompt token ids in {path.name}"


def test_size_limits(stack: Stack) -> None:
    cases = {
        grpc.StatusCode.RESOURCE_EXHAUSTED: _request("x" * (5 << 20)),  # over the gateway's 4 MiB message limit
        grpc.StatusCode.INVALID_ARGUMENT: _request("x" * ((1 << 20) + 1)),  # over max_prompt_chars
    }
    for code, request in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            stack.gateway.stub.Generate(request, timeout=30)
        assert info.value.code() == code
    with pytest.raises(grpc.RpcError) as info:
        stack.gateway.stub.Generate(gateway_pb2.GenerateRequest(messages=[
            gateway_pb2.ChatMessage(role="user", content="hi")] * 1025), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in info.value.details()
    with grpc.insecure_channel(stack.compute.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(compute_pb2_grpc.ComputeStub(channel).Generate(compute_pb2.GenerateRequest(
                prompt_token_ids=[65] * 5000, params=compute_pb2.SamplingParams(max_tokens=1)), timeout=30))
    # The prompt alone is longer than the model: named as the field that is too long.
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in info.value.details()


def test_cache_salt_isolates_the_prefix_cache(stack: Stack) -> None:
    prompt = "A prefix that only tenant A may reuse, several blocks long, for the salt test. " * 2

    def cached(salt: str) -> int:
        return stack.gateway.stub.Generate(_request(prompt, cache_salt=salt), timeout=30).usage.cached_prompt_tokens

    assert cached("tenant-a") == 0
    stack.gateway.stub.Generate(_request("commit the previous step's blocks"), timeout=30)
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached("") == 0
    stack.wait_idle()


def _listen_hosts(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (Linux /proc/net/tcp, IPv4)."""
    hosts = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            hosts.add(".".join(str(b) for b in reversed(bytes.fromhex(host_hex))))
    return hosts


def test_metrics_listen_on_loopback_only(stack: Stack) -> None:
    assert _listen_hosts(stack.gateway.metrics_port) == {"127.0.0.1"}
