"""Fairness between tenants on a live stack: tenant a's backlog fills an engine
of 2 slots; tenant b's one short request must finish before a's backlog drains. Judged by the order
of completion and by the per-tenant queue gauges, never by times.

Before: the compute service admitted first come, first served, so b's request finished after every
one of a's (8 of a's before it).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from pagedserve.stack import Stack, StackConfig, start_stacks
from pagedserve_testing.stack import Gateway, compute_load, start_gateway
from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.conftest import BLOCK_SIZE

KEY_A, KEY_B = "fair-a-key-5d1e0c7b", "fair-b-key-93a2f6e4"
NUM_A = 8


@pytest.fixture(scope="module")
def fair_stack(service_model: ServiceModel, run_dir: Path) -> Iterator[tuple[Stack, Gateway, int]]:
    """One engine with 2 slots (its metrics on a known port) and a gateway with tenants a and b."""
    compute_metrics = free_port()
    config = StackConfig(model=str(service_model.path), name="fair-", ready_timeout_s=120,
                         memory_args=("--max-num-blocks", "256", "--block-size", str(BLOCK_SIZE),
                                      "--log-level", "warning"),
                         compute_args=("--block-size", str(BLOCK_SIZE), "--max-num-seqs", "2",
                                       "--num-speculative-tokens", "0", "--metrics-port", str(compute_metrics),
                                       "--max-queued-requests", "12"))  # 9 per tenant
    [stack] = start_stacks([Stack(config, run_dir)], with_gateway=False)
    keys = run_dir / "fair-tenants.json"
    keys.write_text(json.dumps({"tenants": {"a": {"keys": [KEY_A]}, "b": {"keys": [KEY_B]}}}))
    try:
        gateway = start_gateway([stack.compute_address], run_dir, "--api-keys-file", str(keys),
                                "--max-queued-requests", "32")
    except BaseException:
        stack.stop()
        raise
    yield stack, gateway, compute_metrics
    assert gateway.stop() == 0
    assert all(status == 0 for status in stack.stop().values())


def _metric(port: int, name: str, labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _request(max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="fair share", params=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_a_newcomer_finishes_before_anothers_backlog(fair_stack: tuple[Stack, Gateway, int]) -> None:
    stack, gateway, compute_metrics = fair_stack
    finished: list[str] = []  # names in order of completion (list.append is atomic)
    errors: list[BaseException] = []

    def run(name: str, key: str, max_tokens: int) -> None:
        try:
            reply = gateway.stub.Generate(_request(max_tokens), metadata=[("authorization", f"Bearer {key}")],
                                          timeout=300)
            assert reply.usage.completion_tokens == max_tokens
            finished.append(name)
        except BaseException as exc:  # reported by the test's thread below
            errors.append(exc)

    # 480 tokens each: long enough that a0 and a1 still run when a7 arrives on a loaded machine (at 48,
    # two of a's could finish before the last had come, and the backlog of 6 was never seen).
    threads = [threading.Thread(target=run, args=(f"a{i}", KEY_A, 480)) for i in range(NUM_A)]
    for thread in threads:
        thread.start()
    assert stack.compute is not None
    # a saturates the engine: 2 running, 6 waiting, seen by the engine and by both gauges.
    wait_until(lambda: compute_load(stack.compute.address).num_waiting == NUM_A - 2, 60, "a's backlog queued")
    assert compute_load(stack.compute.address).num_running == 2
    assert _metric(compute_metrics, "pagedserve_compute_tenant_requests", '{state="waiting",tenant="a"}') == 6
    assert _metric(gateway.metrics_port, "pagedserve_gateway_tenant_waiting_requests", '{tenant="a"}') == 6
    newcomer = threading.Thread(target=run, args=("b", KEY_B, 4))
    newcomer.start()
    for thread in [*threads, newcomer]:
        thread.join(timeout=300)
    assert not errors, errors
    assert sorted(finished) == sorted([*(f"a{i}" for i in range(NUM_A)), "b"])
    # b is admitted at the first free slot (after a0 and a1, which ran when it came), so at most
    # the two a's then running finish before it; first come, first served put all 8 before it.
    assert finished.index("b") <= 2, finished
    assert _metric(gateway.metrics_port, "pagedserve_gateway_tenant_waiting_requests", '{tenant="a"}') == 0


def test_one_tenant_cannot_fill_the_compute_queue(fair_stack: tuple[Stack, Gateway, int]) -> None:
    """--max-queued-requests 12: tenant a holds at most 9 (3/4), the 10th is refused naming its share,
    and tenant b still gets in. Before: a took all 12 and b was refused (max_queued_requests)."""
    stack, _, compute_metrics = fair_stack
    assert stack.compute is not None
    channel = grpc.insecure_channel(stack.compute.address)
    stub = compute_pb2_grpc.ComputeStub(channel)
    params = compute_pb2.SamplingParams(max_tokens=400, temperature=1.0, seed=1, ignore_eos=True)

    def stream(tenant: str, i: int):
        return stub.Generate(compute_pb2.GenerateRequest(request_id=f"{tenant}-q{i}", prompt_token_ids=[5, 6, 7],
                                                         params=params, tenant=tenant), timeout=120)

    held = [stream("a", i) for i in range(9)]
    try:
        wait_until(lambda: compute_load(stack.compute.address).num_running
                   + compute_load(stack.compute.address).num_waiting == 9, 60, "a's 9 requests in flight")
        with pytest.raises(grpc.RpcError) as info:
            next(stream("a", 9))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'a' holds 9 requests in flight, its share (max_queued_per_tenant)" in info.value.details()
        newcomer = stream("b", 0)  # accepted: it waits in the engine for a's next free slot
        held.append(newcomer)
        wait_until(lambda: _metric(compute_metrics, "pagedserve_compute_tenant_requests",
                                   '{state="waiting",tenant="b"}') == 1, 60, "b's request queued")
        assert newcomer.running()
    finally:
        for call in held:
            call.cancel()
        channel.close()
    wait_until(lambda: compute_load(stack.compute.address).num_running == 0, 60, "the cancelled requests aborted")
