"""Faults on the live stack: a compute service SIGKILLed mid-stream, the memory service SIGKILLed,
a compute service hung by SIGSTOP. Each test leaves the stack serving again, every block free."""

from __future__ import annotations

import signal

import grpc
import pytest

from pagedserve_testing.stack import LEASE_TTL_S, NOT_SERVING, SERVING, Stack
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.stack import shm_segments

CACHED_PROMPT = "The prefix cache lives in the memory service and outlives the compute service. " * 2


def _request(prompt: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, params=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def _long_stream(stack: Stack, prompt: str):
    """A stream that runs for seconds, already producing tokens (sampled: greedy tokens may come
    several a step, speculative drafts accepted, and end it sooner)."""
    request = _request(prompt, 600)
    request.params.temperature, request.params.seed = 1.0, 11
    stream = stack.gateway.stub.GenerateStream(request, timeout=120)
    next(stream)
    return stream


def _failure(stream) -> grpc.StatusCode:
    """How the stream ends: a stream left hanging would end with its 120 s DEADLINE_EXCEEDED, which
    the callers' UNAVAILABLE rules out (no wall-clock limit to trip on a loaded machine)."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    return info.value.code()


def _serves(stack: Stack) -> None:
    wait_until(lambda: stack.gateway.num_healthy_backends() == 1, 30, "the backend back in rotation")
    # A restarted compute service's first step may load the fused CPU kernels: give it time.
    reply = stack.gateway.stub.Generate(_request("serving again", 3), timeout=300)
    assert reply.usage.completion_tokens == 3


def test_sigkill_compute_mid_stream(stack: Stack) -> None:
    warm = stack.gateway.stub.Generate(_request(CACHED_PROMPT, 2), timeout=30)
    stream = _long_stream(stack, CACHED_PROMPT + "and then some more text")
    stack.compute.kill()
    assert _failure(stream) == grpc.StatusCode.UNAVAILABLE
    # The lease ends with the dead client's connection (or its TTL): every block comes back.
    stats = stack.wait_idle(timeout_s=LEASE_TTL_S + 8)
    assert stats.num_clients == 0
    stack.restart_compute()
    _serves(stack)
    again = stack.gateway.stub.Generate(_request(CACHED_PROMPT, 2), timeout=30)
    assert again.usage.cached_prompt_tokens > 0, "the restarted compute service found the prefix cache cold"
    assert again.choices[0].token_ids == warm.choices[0].token_ids
    stack.wait_idle()


def test_sigkill_memory_then_both_recover(stack: Stack) -> None:
    stream = _long_stream(stack, "in flight when the memory service dies")
    killed = stack.memory.pid
    stack.memory.kill()
    assert _failure(stream) == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: stack.compute_health() == NOT_SERVING, 10, "compute NOT_SERVING")
    with pytest.raises(grpc.RpcError) as info:
        stack.gateway.stub.Generate(_request("nobody home", 2), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    stack.restart_memory()
    wait_until(lambda: stack.compute_health() == SERVING, 20, "compute SERVING again")
    _serves(stack)
    assert stack.memory_stats().num_clients == 1
    stack.wait_idle()
    # A SIGKILLed service cannot unlink its pool itself; it must not stay behind all the same.
    wait_until(lambda: not shm_segments(killed), 10,
               f"the killed memory service's segment gone ({shm_segments(killed)})")


def test_sigstop_takes_compute_out_of_rotation_and_sigcont_puts_it_back(stack: Stack) -> None:
    stack.compute.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: stack.gateway.num_healthy_backends() == 0, 15, "the hung backend out of rotation")
        with pytest.raises(grpc.RpcError) as info:  # at once, not after the 10 s deadline
            stack.gateway.stub.Generate(_request("anyone there", 2), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.compute.send_signal(signal.SIGCONT)
    _serves(stack)
    stack.wait_idle()
