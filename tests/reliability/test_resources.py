"""Resource limits: every per-request dimension that costs memory is bounded (INVALID_ARGUMENT
naming the field), and thousands of requests leave no descriptor or thread behind in any process.

The benchmark counts growth over 10,000 requests; here a few hundred after a warm-up.
"""

from __future__ import annotations

import grpc
import pytest

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve_testing import load
from pagedserve_testing.stack import Stack

WARMUP, NUM_REQUESTS = 80, 240
# A grpc server may add a worker thread or a descriptor now and then (pollers, a new connection);
# growth with the number of requests is what must not happen.
SLACK = {"fds": 3, "threads": 3}


@pytest.mark.parametrize(("field_name", "params"), [
    ("params.n", {"n": 65, "temperature": 1.0}),
    ("params.logprobs", {"logprobs": 21}),
    ("params.stop", {"stop": ["x"] * 17}),
    ("params.stop", {"stop": ["y" * 257]}),
    ("params.max_tokens", {"max_tokens": 2000}),
])
def test_per_request_bounds(stack: Stack, field_name: str, params: dict) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stack.gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt="bounded", params=gateway_pb2.SamplingParams(
            **params)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in info.value.details()


def test_no_descriptor_or_thread_growth(stack: Stack) -> None:
    assert set(load.churn(stack.gateway.address, WARMUP)) <= {"OK", "CANCELLED", "INVALID_ARGUMENT"}
    stack.wait_idle()
    before = stack.resources()
    tally = load.churn(stack.gateway.address, NUM_REQUESTS)
    assert set(tally) <= {"OK", "CANCELLED", "INVALID_ARGUMENT"}, tally
    assert tally["OK"] >= NUM_REQUESTS // 2 - 1
    stack.wait_idle()
    after = stack.resources()
    for name in before:
        for kind, slack in SLACK.items():
            assert after[name][kind] <= before[name][kind] + slack, (name, kind, before, after)
