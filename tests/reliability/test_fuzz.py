"""Fuzzing the live stack: hostile requests to the gateway, the compute service and the memory
service get deliberate status codes (never INTERNAL, UNKNOWN or a hang), every service still serves
afterwards, and the memory service accounts for every block with nothing left held.

The benchmark runs the same generator with 10,000 cases per service; here a few hundred keep CI fast.
"""

from __future__ import annotations

from collections import Counter

import pytest

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve_testing import fuzz
from pagedserve_testing.stack import Stack, kv_layout

NUM_CASES = 150


def _check(tally: Counter[str], stack: Stack) -> None:
    bad = {code: n for code, n in tally.items() if code in fuzz.BAD_CODES}
    assert not bad, f"status codes that must never answer a request: {bad} (tally {dict(tally)})"
    assert tally["OK"] > 0 and tally["INVALID_ARGUMENT"] > 0, dict(tally)  # both paths were exercised
    assert stack.all_serving()
    stack.wait_idle()


def test_gateway_fuzz(stack: Stack) -> None:
    tally = fuzz.run_cases(stack.gateway.address, fuzz.gateway_cases(NUM_CASES, seed=1), concurrency=4,
                           timeout_s=60)
    _check(tally, stack)
    reply = stack.gateway.stub.Generate(gateway_pb2.GenerateRequest(
        prompt="still here", params=gateway_pb2.SamplingParams(max_tokens=3, ignore_eos=True)), timeout=30)
    assert reply.usage.completion_tokens == 3


def test_compute_fuzz(stack: Stack, service_model) -> None:
    tally = fuzz.run_cases(stack.compute.address, fuzz.compute_cases(NUM_CASES, service_model.vocab_size, seed=2),
                           concurrency=4, timeout_s=60)
    _check(tally, stack)
    assert stack.compute_load().num_running == 0


def test_memory_fuzz(stack: Stack) -> None:
    """A client of its own attaches and sends random steps, then detaches: whatever it did, every
    block comes back and the compute service's lease is untouched."""
    tally = fuzz.run_memory_fuzz(stack.memory.address, kv_layout(stack.config.model, stack.config.block_size),
                                 NUM_CASES, seed=3)
    _check(tally, stack)
    assert stack.memory_stats().num_clients == 1  # the compute service's lease only


@pytest.mark.parametrize("target", ["gateway", "compute", "memory"])
def test_malformed_bytes_are_invalid_argument(stack: Stack, target: str) -> None:
    """Regression: a request that does not parse (invalid UTF-8 in a string field, truncation) was
    answered UNKNOWN by the asyncio servers and INTERNAL by the threaded one."""
    method = {"gateway": "/pagedserve.gateway.v1.Gateway/Generate",
              "compute": "/pagedserve.compute.v1.Compute/Abort",
              "memory": "/pagedserve.memory.v1.MemoryManager/Detach"}[target]
    address = {"gateway": stack.gateway.address, "compute": stack.compute.address,
               "memory": stack.memory.address}[target]
    for data in (b"\x0a\x03\xff\xfe\xfd", b"\x0a\x32abc", b"\xff\xff\xff\xff"):
        assert fuzz.send_raw(address, method, data) == "INVALID_ARGUMENT", (target, data)


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 3.4e38])
def test_extreme_temperatures_sample_and_keep_the_engine_up(stack: Stack, temperature: float) -> None:
    """Regression: temperature 1e-45 overflowed the logits to inf, the sampler raised, and the
    engine loop failed every running request and re-attached to its memory service."""
    params = gateway_pb2.SamplingParams(max_tokens=3, ignore_eos=True, temperature=temperature, seed=7)
    reply = stack.gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt="sample me", params=params), timeout=30)
    assert reply.usage.completion_tokens == 3
    assert stack.all_serving()
