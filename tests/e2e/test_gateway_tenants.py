"""Tenants on a live gateway: each key is a tenant with its own concurrency
share, priority cap and prefix-cache namespace; a stream whose client stops reading is ended and
its backend request aborted. One gateway with a JSON tenants file, in front of one of the session's
engines (one prefix cache, so cache hits are deterministic)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from tests.e2e.conftest import Engine, Gateway, start_gateway

KEY_A, KEY_B, KEY_C = "tenant-a-key-7f3c91d2", "tenant-b-key-0a6e4b58", "tenant-c-key-5b21e9a7"
TENANTS = {"tenants": {"team-a": {"keys": [KEY_A], "max_priority": 5, "max_concurrent": 1},
                       "team-b": {"keys": [KEY_B]},
                       "team-c": {"keys": [KEY_C], "max_requests_per_s": 0.2}}}
HTTP_PORT = free_port()
STALL_S = 1.0


@pytest.fixture(scope="module")
def tenanted(engines: list[Engine], run_dir: Path) -> Iterator[Gateway]:
    keys = run_dir / "tenants.json"
    keys.write_text(json.dumps(TENANTS))
    started = start_gateway([engines[0].address], run_dir, "--api-keys-file", str(keys),
                            "--max-queued-requests", "8", "--write-stall-timeout-s", str(STALL_S),
                            "--http-port", str(HTTP_PORT))
    yield started
    assert started.stop() == 0
    log = started.log_file.read_text()
    assert '"tenant": "team-a"' in log and '"tenant": "team-b"' in log  # logs name the tenant ...
    assert KEY_A not in log and KEY_B not in log  # ... never its key


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


# Streams that must still run while the test acts sample: greedy ones may be drafted (speculative
# decoding) several tokens a step and end sooner.
LONG_SAMPLED = {"temperature": 1.0, "seed": 3}


def _request(prompt: str = "tenant", max_tokens: int = 2, **fields: object) -> gateway_pb2.GenerateRequest:
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    params.update(fields.pop("params", {}))
    return gateway_pb2.GenerateRequest(prompt=prompt, params=gateway_pb2.SamplingParams(**params), **fields)


def _metric(gateway: Gateway, name: str, labels: str = "") -> float:
    """One sample of the gateway's Prometheus text (0.0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def test_one_tenant_at_its_limit_leaves_the_others_their_share(tenanted: Gateway, engines: list[Engine]) -> None:
    """Item 4 (and 7: Tokenize is admitted like Generate)."""
    stream = tenanted.stub.GenerateStream(_request(max_tokens=300, params=LONG_SAMPLED), metadata=_auth(KEY_A),
                                          timeout=60)
    next(stream)
    for call, request in ((tenanted.stub.Generate, _request()), (tenanted.stub.Tokenize,
                                                                   gateway_pb2.TokenizeRequest(prompt="tok"))):
        code, details = _code(call, request, metadata=_auth(KEY_A), timeout=30)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'team-a' holds 1 requests, its max_concurrent (1)" in details
    assert _metric(tenanted, "pagedserve_gateway_tenant_requests", '{tenant="team-a"}') == 1
    assert tenanted.stub.Generate(_request(), metadata=_auth(KEY_B), timeout=30).usage.completion_tokens == 2
    reply = tenanted.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="tok"), metadata=_auth(KEY_B), timeout=30)
    assert "".join(reply.tokens) == "tok" and len(reply.token_ids) == 3  # a byte tokenizer
    stream.cancel()
    wait_until(lambda: _metric(tenanted, "pagedserve_gateway_tenant_requests", '{tenant="team-a"}') == 0,
               what="team-a's slot released")
    wait_until(lambda: engines[0].load().num_running == 0, what="the cancelled stream aborted")
    assert tenanted.stub.Generate(_request(), metadata=_auth(KEY_A), timeout=30).usage.completion_tokens == 2
    assert _metric(tenanted, "pagedserve_gateway_queue_length") == 0


def test_priority_above_the_tenants_maximum_is_permission_denied(tenanted: Gateway) -> None:
    """Item 5: team-b has the default max_priority 0, team-a was granted 5."""
    code, details = _code(tenanted.stub.Generate, _request(priority=1), metadata=_auth(KEY_B), timeout=30)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "max_priority of tenant 'team-b' (0)" in details
    code, _ = _code(lambda *a, **k: list(tenanted.stub.GenerateStream(*a, **k)), _request(priority=2147483647),
                    metadata=_auth(KEY_A), timeout=30)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert tenanted.stub.Generate(_request(priority=0), metadata=_auth(KEY_B), timeout=30).usage.completion_tokens == 2
    assert tenanted.stub.Generate(_request(priority=5), metadata=_auth(KEY_A), timeout=30).usage.completion_tokens == 2
    assert _metric(tenanted, "pagedserve_gateway_tenant_requests", '{tenant="team-a"}') == 0


def test_the_prefix_cache_is_per_tenant(tenanted: Gateway) -> None:
    """Item 6: B gets no hit on A's prompt; A's repeat does; A's cache_salt narrows within A."""
    prompt = "PIN 4 of tenant A, several blocks long so that the prefix cache holds some of it. " * 2

    def cached(key: str, salt: str = "") -> int:
        reply = tenanted.stub.Generate(_request(prompt, cache_salt=salt), metadata=_auth(key), timeout=30)
        return reply.usage.cached_prompt_tokens

    assert cached(KEY_A) == 0
    tenanted.stub.Generate(_request("commit the previous step's blocks"), metadata=_auth(KEY_A), timeout=30)
    assert cached(KEY_B) == 0
    assert cached(KEY_A) > 0
    assert cached(KEY_A, salt="narrower") == 0
    assert cached(KEY_B) > 0  # B's own first request is now B's to reuse


def test_a_stream_whose_client_stops_reading_is_ended_and_aborted(tenanted: Gateway, engines: list[Engine]) -> None:
    """Item 4's write-stall timeout: a client with a ~1 KiB window reads one message, then nothing."""
    channel = grpc.insecure_channel(tenanted.address, options=[("grpc.http2.lookahead_bytes", 1024),
                                                               ("grpc.http2.bdp_probe", 0)])
    stub = gateway_pb2_grpc.GatewayStub(channel)
    stalls = _metric(tenanted, "pagedserve_gateway_write_stalls_total")
    stream = stub.GenerateStream(_request(max_tokens=900, params={"logprobs": 5, **LONG_SAMPLED}),
                                 metadata=_auth(KEY_B), timeout=60)
    first = next(stream)
    wait_until(lambda: _metric(tenanted, "pagedserve_gateway_write_stalls_total") == stalls + 1, timeout_s=30,
               what="the stalled stream ended")
    wait_until(lambda: _metric(tenanted, "pagedserve_gateway_tenant_requests", '{tenant="team-b"}') == 0,
               what="its slot released")
    wait_until(lambda: engines[0].load().num_running == 0, what="its backend request aborted")
    pieces = [first]
    with pytest.raises(grpc.RpcError) as info:
        pieces += list(stream)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "write_stall_timeout_s" in info.value.details()
    assert sum(len(p.token_ids) for p in pieces) < 900 and not any(p.finish_reason for p in pieces)
    channel.close()


def test_a_tenant_past_its_request_rate_is_refused_before_its_request_is_read(tenanted: Gateway) -> None:
    """team-c may send 0.2 requests a second (a burst of one): its first request is served, the next
    ones are refused on both fronts (RESOURCE_EXHAUSTED / 429, with the time to wait) before the
    request is converted, the HTTP one before its body is read; other tenants are not affected."""
    stub = tenanted.stub
    assert stub.Generate(_request(), metadata=_auth(KEY_C), timeout=60).usage.completion_tokens == 2
    code, details = _code(stub.Generate, _request(), metadata=_auth(KEY_C), timeout=60)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.fullmatch(r"tenant 'team-c' sends more than its max_requests_per_s \(0\.2 a second\); "
                        r"retry in [0-9.]+ s", details), details
    body = b"{" * 1000  # not JSON: read, it would be a 400
    http = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}/v1/completions", data=body, method="POST",
                                  headers={"Authorization": f"Bearer {KEY_C}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(http, timeout=30)
    assert info.value.code == 429
    assert "max_requests_per_s" in json.loads(info.value.read())["error"]["message"]
    for path in ("/v1/models", "/v1/models/x", "/tokenizer_info"):  # the endpoints without a body too
        listing = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}{path}",
                                         headers={"Authorization": f"Bearer {KEY_C}"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(listing, timeout=30)
        assert info.value.code == 429, path
    assert stub.Generate(_request(), metadata=_auth(KEY_B), timeout=60).usage.completion_tokens == 2
