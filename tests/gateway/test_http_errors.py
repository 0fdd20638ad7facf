"""What error answers and log lines repeat of a hostile request: counts and
a few short names, never whole values, and no transport internals."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from gateway.backend.dispatch import _client_error
from gateway.core.validate import _check_int32
from gateway.openai_api.app import as_http_error
from gateway.openai_api.schema import CompletionRequest, error_param, unknown_fields
from pagedserve import sampling_rules
from pagedserve.errors import InvalidArgument, UnavailableError, echo

HUGE = int("9" * 4300)  # Python's longest integer that str() still converts


def test_unknown_fields_are_counted_and_a_few_named() -> None:
    """270k unknown fields made one 2.97 MB log line; now a count and five names, each cut short."""
    fields = {f"field_{i}": 0 for i in range(270_000)} | {"x" * 10_000: 1}
    body = CompletionRequest.model_validate({"prompt": "a", **fields})
    summary = unknown_fields(body)
    assert summary["num_fields"] == 270_001
    assert summary["fields"] == [f"field_{i}" for i in range(5)]
    assert len(json.dumps(summary)) < 200
    long_first = unknown_fields(CompletionRequest.model_validate({"prompt": "a", "y" * 10_000: 1}))
    assert long_first == {"num_fields": 1, "fields": ["y" * 64 + "..."]}


@pytest.mark.parametrize(("field", "value"), [
    ("seed", HUGE), ("seed", -HUGE), ("seed", 10**5000), ("n", HUGE), ("min_tokens", HUGE), ("top_k", -HUGE),
    ("temperature", -HUGE), ("max_tokens", -10**5000)],
    ids=["seed", "-seed", "seed-5001", "n", "min_tokens", "-top_k", "-temperature", "-max_tokens-5001"])
def test_out_of_range_values_are_echoed_short(field: str, value: int) -> None:
    """A 4300-digit seed was echoed whole (4.3 KB); beyond 4300 digits str() itself raised (INTERNAL)."""
    with pytest.raises(InvalidArgument) as info:
        sampling_rules.check_sampling(sampling_rules.resolve_sampling({field: value}))
    message = str(info.value)
    assert len(message) < 150 and "digits" in message, message
    assert as_http_error(info.value).status == 400
    with pytest.raises(InvalidArgument, match="priority must be a 32-bit integer, got an integer of about"):
        _check_int32("priority", value if value > 0 else -value)


def test_echo_of_numbers_and_strings() -> None:
    assert (echo(5), echo(-1), echo(1.5), echo("ab")) == ("5", "-1", "1.5", "'ab'")
    assert echo(10**5000) == "an integer of about 5001 digits"  # str() would raise beyond 4300 digits
    assert echo(-HUGE).startswith("-an integer of about 430")  # 4300 or 4301: from the bit length


def test_pydantic_error_param_is_cut_short() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "a", "logit_bias": {"k" * 100_000: "not a number"}})
    param = error_param(info.value.errors()[0]["loc"])
    assert param == "logit_bias." + "k" * 64 + "..."


def test_transport_failures_say_backend_unavailable_and_nothing_more() -> None:
    for code, details in ((grpc.StatusCode.UNAVAILABLE, "Stream removed (recvmsg:Connection reset by peer (104))"),
                          (grpc.StatusCode.UNKNOWN, "failed to connect to all addresses; last error: "
                                                    "ipv4:10.1.2.3:50052: Connection refused")):
        error = _client_error(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details))
        assert isinstance(error, UnavailableError) and str(error) == "backend unavailable"
        answer = as_http_error(error)
        assert (answer.status, answer.message) == (503, "backend unavailable")
    # The compute service's own verdicts still reach the client as they are.
    bad = _client_error(grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                             grpc.aio.Metadata(), "params.top_k must be >= 0, got -2"))
    assert isinstance(bad, InvalidArgument) and str(bad) == "params.top_k must be >= 0, got -2"
