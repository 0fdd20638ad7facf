"""The gateway bounds every repeated or sized field, answers with short messages, and refuses a
unary reply it could not send before any backend work (the session's engines, two gateways)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from tests.e2e.conftest import Engine, Gateway, start_gateway

# A gateway whose replies may hold 16 KiB: n=2 x 80 tokens with logprobs=20 need at least 107 bytes
# a token (17,120 bytes), so they are refused up front; 1 x 150 need at least 16,050, so they are
# started, and stopped once the reply being built passes the limit.
SMALL_REPLY_BYTES = 16 << 10


@pytest.fixture(scope="module")
def small_replies(engines: list[Engine], run_dir: Path) -> Iterator[Gateway]:
    config = run_dir / "small-replies.json"
    config.write_text(json.dumps({"max_message_bytes": SMALL_REPLY_BYTES}))
    started = start_gateway([e.address for e in engines], run_dir, "--config", str(config))
    wait_until(lambda: started.num_healthy_backends() == 2, what="both backends in rotation")
    yield started
    assert started.stop() == 0


def _request(**params: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="limits", params=gateway_pb2.SamplingParams(temperature=0.0, **params))


def _refused(call, request: gateway_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        reply = call(request, timeout=30)
        if not isinstance(reply, gateway_pb2.GenerateResponse):
            list(reply)  # a stream: read it to its status
    return info.value


def test_one_stop_id_over_the_limit_is_invalid_argument(gateway: Gateway) -> None:
    for call in (gateway.stub.Generate, gateway.stub.GenerateStream):
        error = _refused(call, _request(max_tokens=2, stop_token_ids=[1] * 1025))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "params.stop_token_ids: at most 1024 ids, got 1025"
    at_limit = gateway.stub.Generate(_request(max_tokens=2, stop_token_ids=[1] * 1024), timeout=30)
    assert at_limit.usage.completion_tokens <= 2 and at_limit.choices[0].finish_reason in ("length", "stop")


def test_a_huge_role_is_echoed_in_a_short_message(gateway: Gateway) -> None:
    """Before: the 1e6-character role was echoed whole and the answer overflowed the metadata limit."""
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="r" * 1_000_000, content="hi")])
    error = _refused(gateway.stub.Generate, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("messages[0].role must be one of") and error.details().endswith("...")
    assert len(error.details()) < 160


def test_messages_are_bounded_in_total_size(gateway: Gateway) -> None:
    half = "x" * (600 << 10)  # two of them: over the 1 Mi characters of all messages together
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content=half)] * 2)
    error = _refused(gateway.stub.Generate, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("messages: at most")


def test_a_unary_reply_too_large_to_send_is_refused_up_front(small_replies: Gateway, engines: list[Engine]) -> None:
    """Before: the backends generated all of it, then the reply failed RESOURCE_EXHAUSTED."""
    big = _request(n=2, max_tokens=80, logprobs=20, ignore_eos=True)
    error = _refused(small_replies.stub.Generate, big)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "use GenerateStream" in error.details()
    # The same request streamed is served whole; a short unary one still fits.
    pieces = list(small_replies.stub.GenerateStream(big, timeout=60))
    assert sum(len(p.token_ids) for p in pieces) == 160 and sum(len(p.logprobs) for p in pieces) == 160
    short = small_replies.stub.Generate(_request(max_tokens=4, logprobs=2, ignore_eos=True), timeout=30)
    assert short.usage.completion_tokens == 4 and len(short.choices[0].logprobs) == 4


def test_a_unary_reply_that_outgrows_the_limit_is_stopped(small_replies: Gateway, engines: list[Engine]) -> None:
    """Not refusable up front (it might have fit): stopped, and aborted on its backend, once the reply
    being built passes the limit, with the same advice."""
    error = _refused(small_replies.stub.Generate, _request(max_tokens=150, logprobs=20, ignore_eos=True))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "use GenerateStream" in error.details()
    wait_until(lambda: all(e.load().num_running + e.load().num_waiting == 0 for e in engines), what="aborted")
