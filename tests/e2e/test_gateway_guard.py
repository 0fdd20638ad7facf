"""A gateway that protects itself: API keys, a bounded queue, and a graceful SIGTERM.

One extra gateway (keys from a file and from the environment, a queue of one request) in front of
the session's engines; the SIGTERM test ends it, so it runs last.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.drain import GATEWAY_STOP_S

from gateway.config import API_KEYS_ENV
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.process import wait_until
from tests.e2e.conftest import Engine, Gateway, start_gateway

FILE_KEY, ENV_KEY = "file-key-0123456789", "env-key-9876543210"
DRAIN_DELAY_S = 1
GRACE_PERIOD_S = 10  # pagedserve_testing.stack.gateway_args


@pytest.fixture(scope="module")
def guarded(engines: list[Engine], run_dir: Path) -> Iterator[Gateway]:
    keys = run_dir / "keys.txt"
    keys.write_text(f"# one key per line\n{FILE_KEY}\n")
    env = {**os.environ, API_KEYS_ENV: ENV_KEY}
    started = start_gateway([e.address for e in engines], run_dir, "--api-keys-file", str(keys),
                            "--max-queued-requests", "1", "--drain-delay-s", str(DRAIN_DELAY_S), env=env)
    yield started
    started.stop()


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _request(max_tokens: int = 4, **kwargs: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="guarded", params=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, **kwargs))


def test_api_keys_from_file_and_environment(guarded: Gateway) -> None:
    for metadata in ([], _auth("wrong-key"), _auth(FILE_KEY[:-1]), [("authorization", FILE_KEY)]):
        with pytest.raises(grpc.RpcError) as info:
            guarded.stub.Generate(_request(), metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(guarded.stub.GenerateStream(_request(), metadata=metadata, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for key in (FILE_KEY, ENV_KEY):
        assert guarded.stub.Generate(_request(), metadata=_auth(key), timeout=30).usage.completion_tokens == 4
    # Health stays open (probes carry no keys).
    reply = health_pb2_grpc.HealthStub(guarded.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_backpressure_beyond_the_queue_is_resource_exhausted(guarded: Gateway, engines: list[Engine]) -> None:
    stream = guarded.stub.GenerateStream(_request(200, ignore_eos=True), metadata=_auth(FILE_KEY), timeout=60)
    next(stream)
    with pytest.raises(grpc.RpcError) as info:
        guarded.stub.Generate(_request(), metadata=_auth(FILE_KEY), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stream.cancel()
    wait_until(lambda: all(e.load().num_running == 0 for e in engines), what="the stream aborted")
    assert guarded.stub.Generate(_request(), metadata=_auth(FILE_KEY), timeout=30).usage.completion_tokens == 4


def test_sigterm_stops_serving_but_lets_the_stream_finish(guarded: Gateway) -> None:
    """Readiness fails first, the stream in flight is delivered whole, and the gateway has exited within
    the bound the chart's grace period is derived from (drain delay + grace period + GATEWAY_STOP_S)."""
    health = health_pb2_grpc.HealthStub(guarded.channel)
    # 8 completions with 20 logprobs a token, on a channel without BDP probing, whose client reads
    # nothing until after the signal: more than HTTP/2's 64 KiB window, so the call is still open
    # in the gateway when the signal comes.
    channel = grpc.insecure_channel(guarded.process.address, options=[("grpc.http2.bdp_probe", 0)])
    stream = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(
        _request(100, ignore_eos=True, logprobs=20, n=8), metadata=_auth(FILE_KEY), timeout=60)
    pieces = [next(stream)]
    sigterm_at = time.monotonic()
    guarded.process.send_signal(signal.SIGTERM)
    # NOT_SERVING first (load balancers stop sending; the drain delay gives them time to notice).
    wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
               == health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=2, what="NOT_SERVING")
    not_serving_at = time.monotonic()
    pieces += list(stream)  # the in-flight stream runs to its end within the grace period
    assert not_serving_at < time.monotonic()
    finishes = [p for p in pieces if p.finish_reason]
    assert sorted(p.index for p in finishes) == list(range(8)) and {p.finish_reason for p in finishes} == {"length"}
    assert pieces[-1].usage.completion_tokens == 8 * 100
    assert guarded.process.proc.wait(timeout=DRAIN_DELAY_S + GRACE_PERIOD_S + GATEWAY_STOP_S + 20) == 0
    assert time.monotonic() - sigterm_at <= DRAIN_DELAY_S + GRACE_PERIOD_S + GATEWAY_STOP_S
    channel.close()
