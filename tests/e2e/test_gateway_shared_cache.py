"""Prefix affinity across backends that share one memory service, end to end.

Two compute services attached to one memory service share its pool: a prefix that one of them
computed is a cache hit on the other. The gateway learns that from their Info (the same
``memory_service_id``) and routes a repeated prefix to either, the less loaded first, counting both
as predicted pool hits; backends with memory services of their own keep affinity to the one that
served the prefix. Asserted through the routing metric and the replies' cached tokens, never timing.
"""

from __future__ import annotations

import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import ServiceProcess, wait_until
from pagedserve.stack import compute_process, ready
from tests.e2e.conftest import Engine, Gateway, start_gateway

SYSTEM = "You answer in a single word, nothing else at all. " * 2  # ~6 full blocks of 16 bytes


def _info(address: str) -> compute_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return compute_pb2_grpc.ComputeStub(channel).Info(compute_pb2.InfoRequest(), timeout=10)


def _decisions(gateway: Gateway) -> Counter[tuple[str, str]]:
    """pagedserve_gateway_routing_decisions by (backend, prediction)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5).read().decode()
    return Counter({(s.labels["backend"], s.labels["prediction"]): int(s.value)
                    for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name == "pagedserve_gateway_routing_decisions_total"})


def _burst(gateway: Gateway, prefix: str, num: int) -> list[gateway_pb2.GenerateResponse]:
    """``num`` requests with one prefix at once, each long enough (200 tokens) to still run when the
    next is routed, so each sees the others' load."""
    params = gateway_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    def one(i: int) -> gateway_pb2.GenerateResponse:
        return gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt=f"{prefix}Q{i}?", params=params), timeout=120)

    with ThreadPoolExecutor(num) as pool:
        return list(pool.map(one, range(num)))


def _prime(gateway: Gateway, prefix: str) -> None:
    gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt=f"{prefix}first?", params=gateway_pb2.SamplingParams(
        max_tokens=2, temperature=0.0)), timeout=60)


@pytest.fixture(scope="module")
def sibling(engines: list[Engine], run_dir: Path) -> Iterator[ServiceProcess]:
    """A second compute service attached to engine a's memory service."""
    stack = engines[0].services
    process = ready(compute_process(stack.config.model, stack.memory_socket, f"unix:{run_dir}/a2-compute.sock",
                                    ["--memory-token-file", stack.memory_token_file, *stack.config.compute_args],
                                    log_file=run_dir / "a2-compute.log"), 180)
    yield process
    assert process.stop() == 0


def test_backends_on_one_memory_service_report_one_id_and_share_a_prefix(
        engines: list[Engine], sibling: ServiceProcess, run_dir: Path) -> None:
    a, a2, b = (_info(address) for address in (engines[0].address, sibling.address, engines[1].address))
    assert a.memory_service_id == a2.memory_service_id and a.memory_service_id.startswith("ms-")
    assert b.memory_service_id != a.memory_service_id
    gateway = start_gateway([engines[0].address, sibling.address], run_dir)
    try:
        wait_until(lambda: gateway.num_healthy_backends() == 2, what="both backends in rotation")
        _prime(gateway, SYSTEM)
        before = _decisions(gateway)
        replies = _burst(gateway, SYSTEM, 4)
        gained = _decisions(gateway) - before
        # Every request was a predicted pool hit, and the load spread them over both backends ...
        assert sum(gained.values()) == 4 and {p for _, p in gained} == {"pool"}
        assert {backend for backend, _ in gained} == {engines[0].address, sibling.address}
        # ... where each really found the prefix cached: one pool behind both.
        assert all(r.usage.cached_prompt_tokens >= 5 * 16 for r in replies)
    finally:
        assert gateway.stop() == 0


def test_backends_with_memory_services_of_their_own_keep_affinity(gateway: Gateway, engines: list[Engine]) -> None:
    prefix = "Reply with one short word only, thank you kindly. " * 2
    _prime(gateway, prefix)
    before = _decisions(gateway)
    replies = _burst(gateway, prefix, 4)
    gained = _decisions(gateway) - before
    # All four went to the backend that holds the prefix (their load stays within the gap).
    assert sum(gained.values()) == 4 and len(gained) == 1
    [(backend, prediction)] = gained
    assert prediction == "pool" and backend in {e.address for e in engines}
    assert all(r.usage.cached_prompt_tokens >= 5 * 16 for r in replies)
