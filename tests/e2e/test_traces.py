"""Traces end to end: real gateway, compute and memory processes with the tiny
random model, each sending its spans over OTLP/gRPC to a collector inside this test (the
opentelemetry-proto service stubs), and one trace from the client's ``traceparent`` to the KV pool:

    client span (the test's traceparent)
      gateway GenerateStream | gateway OpenAI...      pagedserve-gateway
        gateway.admission
        gateway.backend_call                          (its traceparent in the Generate metadata)
          compute.generate                            pagedserve-compute
            queue, prefill, decode
            memory.step                               pagedserve-memory (the Step that allocated it)
              memory.tier_load                        (a prefix loaded from the disk tier)

A request without a traceparent (or with a malformed one) gets a trace of its own, chained the same way.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from pagedserve.stack import Stack, StackConfig, shm_segments, start_stacks
from pagedserve_testing.stack import Gateway, memory_stats, start_gateway
from pagedserve_testing.tiny_model import ServiceModel
from pagedserve.tracing import SHUTDOWN_TIMEOUT_S, Tracer

BLOCK = 16
POOL_BLOCKS = 16  # small: two filler prompts evict a prompt's blocks to the disk tier
# Byte tokens: 100 tokens, 6 full blocks the pool (and the tier) can cache.
TIER_PROMPT = "Remember this: the tier keeps what the pool forgets, and traces show it. " + "x" * 27


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attributes = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}
                        self._spans.append(Span(resource["service.name"], span.name, span.trace_id.hex(),
                                                span.span_id.hex(), span.parent_span_id.hex(), span.kind,
                                                span.start_time_unix_nano, span.end_time_unix_nano, attributes))
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)


@dataclass
class Traced:
    collector: Collector
    stack: Stack
    gateway: Gateway
    http_url: str


@pytest.fixture(scope="module")
def traced(service_model: ServiceModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    directory = tmp_path_factory.mktemp("traces")
    os.chmod(directory, 0o700)
    trace_args = ("--otlp-traces-endpoint", endpoint)
    stack = Stack(StackConfig(
        model=str(service_model.path), name="traced-", ready_timeout_s=120,
        memory_args=("--block-size", str(BLOCK), "--max-num-blocks", str(POOL_BLOCKS), "--log-level", "warning",
                     "--kv-disk-dir", str(directory / "tier"), *trace_args),
        compute_args=("--dtype", "float32", "--block-size", str(BLOCK), "--max-num-seqs", "4", *trace_args)),
        directory)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch delay (ms): spans within the test's wait
        start_stacks([stack], with_gateway=False)
        http_port = free_port()
        try:
            gateway = start_gateway([stack.compute_address], directory, "--http-port", str(http_port), *trace_args)
        except BaseException:
            stack.stop()
            raise
    try:
        wait_until(lambda: gateway.num_healthy_backends() == 1, what="the backend in rotation")
        yield Traced(collector, stack, gateway, f"http://127.0.0.1:{http_port}")
    finally:
        memory_pid = stack.memory.pid
        assert gateway.stop() == 0
        assert all(status == 0 for status in stack.stop().values())
        assert not shm_segments(memory_pid)
        server.stop(None)


def _traceparent() -> tuple[str, str, str]:
    """A client's traceparent header, its trace id and span id (lower-case hex)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _one(spans: list[Span], name: str, parent: Span | str) -> Span:
    parent_id = parent if isinstance(parent, str) else parent.span_id
    found = [s for s in spans if s.name == name and s.parent_id == parent_id]
    assert len(found) == 1, (name, parent_id, spans)
    return found[0]


def _chain(collector: Collector, gateway_span_name: str, root_parent: str, trace_id: str | None = None,
           request_id: str | None = None, *, with_tier_load: bool = False) -> dict[str, Span]:
    """Waits for the whole chain of one request (by its trace id, or its gateway span's request id)
    and checks every parent-child link; returns the spans by name."""

    def complete() -> dict[str, Span] | None:
        spans = collector.spans()
        if trace_id is None:
            gateways = [s for s in spans if str(s.attributes.get("pagedserve.request_id")).startswith(request_id)
                        and s.service == "pagedserve-gateway"]
            if not gateways:
                return None
            spans = [s for s in spans if s.trace_id == gateways[0].trace_id]
        else:
            spans = [s for s in spans if s.trace_id == trace_id]
        names = {s.name for s in spans}
        wanted = {gateway_span_name, "gateway.admission", "gateway.backend_call", "compute.generate", "queue",
                  "prefill", "decode", "memory.step"} | ({"memory.tier_load"} if with_tier_load else set())
        return {s.name: s for s in spans} if wanted <= names else None

    wait_until(lambda: complete() is not None, 30, f"the spans of {gateway_span_name}")
    by_name = complete()
    assert by_name is not None
    spans = [s for s in collector.spans() if s.trace_id == by_name[gateway_span_name].trace_id]
    front = _one(spans, gateway_span_name, root_parent)
    assert front.service == "pagedserve-gateway" and front.attributes["pagedserve.status"] == "OK"
    admission = _one(spans, "gateway.admission", front)
    call = _one(spans, "gateway.backend_call", front)
    compute = _one(spans, "compute.generate", call)
    assert compute.service == "pagedserve-compute"
    assert compute.attributes["pagedserve.request_id"] == call.attributes["pagedserve.backend_request_id"]
    queue, prefill, decode = (_one(spans, name, compute) for name in ("queue", "prefill", "decode"))
    steps = [s for s in spans if s.name == "memory.step"]
    assert steps and all(s.parent_id == compute.span_id and s.service == "pagedserve-memory" for s in steps)
    # The phases follow each other, inside their parents.
    assert front.start_ns <= admission.start_ns <= admission.end_ns <= call.start_ns <= compute.start_ns
    assert compute.start_ns == queue.start_ns <= queue.end_ns == prefill.start_ns <= prefill.end_ns
    assert prefill.end_ns == decode.start_ns <= decode.end_ns == compute.end_ns <= call.end_ns <= front.end_ns
    # One trace id for the request, end to end: no span of it anywhere else.
    request_id = compute.attributes["pagedserve.request_id"]
    assert [s.trace_id for s in collector.spans() if s.attributes.get("pagedserve.request_id") == request_id] \
        == [front.trace_id]
    return {s.name: s for s in (front, admission, call, compute, queue, prefill, decode)} | {"memory.step": steps[0]}


def _generate(gateway: Gateway, prompt: str, max_tokens: int, metadata: tuple[tuple[str, str], ...] = (),
              request_id: str = "") -> list[int]:
    params = gateway_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(prompt=prompt, params=params, request_id=request_id)
    return [t for piece in gateway.stub.GenerateStream(request, timeout=60, metadata=metadata) for t in piece.token_ids]


def test_a_grpc_request_is_one_trace_from_the_clients_span_to_the_memory_service(traced: Traced) -> None:
    header, trace_id, client_span_id = _traceparent()
    token_ids = _generate(traced.gateway, "trace me, please", 7, (("traceparent", header),))
    assert len(token_ids) == 7
    spans = _chain(traced.collector, "gateway GenerateStream", client_span_id, trace_id)
    assert spans["decode"].attributes["pagedserve.num_output_tokens"] == 7
    assert spans["compute.generate"].attributes["pagedserve.finish_reasons"] == "length"
    assert spans["prefill"].attributes["pagedserve.num_prompt_tokens"] == \
        spans["compute.generate"].attributes["pagedserve.num_prompt_tokens"] > 0
    assert spans["memory.step"].attributes["pagedserve.num_ops"] >= 1


def test_an_http_request_follows_the_traceparent_header(traced: Traced) -> None:
    header, trace_id, client_span_id = _traceparent()
    model = httpx.get(f"{traced.http_url}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{traced.http_url}/v1/completions", headers={"traceparent": header}, timeout=60,
                       json={"model": model, "prompt": "trace me over HTTP", "max_tokens": 5, "temperature": 0,
                             "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    spans = _chain(traced.collector, "gateway OpenAI.Completions", client_span_id, trace_id)
    assert spans["decode"].attributes["pagedserve.num_output_tokens"] == 5


def test_a_request_without_a_traceparent_gets_a_new_trace(traced: Traced) -> None:
    before = {s.trace_id for s in traced.collector.spans()}
    _generate(traced.gateway, "no trace context here", 3, request_id="untraced-grpc")
    spans = _chain(traced.collector, "gateway GenerateStream", "", request_id="untraced-grpc")
    assert spans["gateway GenerateStream"].trace_id not in before
    # A malformed header is no trace context either: a new trace too.
    model = httpx.get(f"{traced.http_url}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{traced.http_url}/v1/completions", timeout=60,
                       headers={"traceparent": "00-not-a-trace-01", "x-request-id": "malformed-http"},
                       json={"model": model, "prompt": "a bad header", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    spans = _chain(traced.collector, "gateway OpenAI.Completions", "", request_id="malformed-http")
    assert spans["gateway OpenAI.Completions"].trace_id not in before


def test_a_prefix_loaded_from_the_disk_tier_is_a_span_of_its_step(traced: Traced) -> None:
    assert len(TIER_PROMPT) == 100
    memory = traced.stack.memory.address
    # The tier also holds the blocks of this module's earlier tests, some perhaps still on their way (the
    # writer has only idle CPU time): this prompt's 6 are those added now, and the count has settled
    # (counting from zero, a late write of its last block let a loaded CI run load 5 of 6).
    looks: list[int] = []

    def settled(at_least: int) -> bool:
        looks.append(memory_stats(memory).tiers[0].num_blocks)
        return looks[-1] >= at_least and len(looks) >= 3 and looks[-3] == looks[-1]

    wait_until(lambda: settled(0), 30, "earlier tests' blocks written behind", interval_s=0.25)
    before = looks[-1]
    first = _generate(traced.gateway, TIER_PROMPT, 2)
    looks.clear()
    wait_until(lambda: settled(before + 6), 30, "the prompt written behind", interval_s=0.25)
    for filler in "ab":  # 10 blocks each: the prompt's 6 leave the pool
        _generate(traced.gateway, f"{filler} " * 80, 2)
    header, trace_id, client_span_id = _traceparent()
    assert _generate(traced.gateway, TIER_PROMPT, 2, (("traceparent", header),)) == first
    spans = _chain(traced.collector, "gateway GenerateStream", client_span_id, trace_id, with_tier_load=True)
    loads = [s for s in traced.collector.spans() if s.trace_id == trace_id and s.name == "memory.tier_load"]
    assert len(loads) == 1
    [load] = loads
    steps = {s.span_id: s for s in traced.collector.spans() if s.trace_id == trace_id and s.name == "memory.step"}
    assert load.parent_id in steps and steps[load.parent_id].attributes["pagedserve.num_tier_loads"] == 1
    assert load.service == "pagedserve-memory"
    assert load.attributes["pagedserve.num_loaded_blocks"] == load.attributes["pagedserve.num_blocks"] == 6
    assert load.attributes["pagedserve.num_disk_blocks"] == 6
    assert spans["prefill"].attributes["pagedserve.num_cached_tokens"] == 96


def _stop_time_s(tracer: Tracer) -> float:
    for _ in range(3):
        tracer.record("s", None, time.monotonic() - 1, time.monotonic())
    start = time.monotonic()
    tracer.shutdown()
    return time.monotonic() - start


def test_a_shutdown_with_the_collector_down_returns_within_its_bound() -> None:
    """The services' stops are bounded (5 s, pagedserve/drain.py): the SDK's retries against a closed
    port (6.8 s before) must not hold one past them."""
    assert _stop_time_s(Tracer(f"http://127.0.0.1:{free_port()}", "t")) < SHUTDOWN_TIMEOUT_S + 0.5


def test_a_shutdown_returns_within_its_bound_whatever_the_exporter_does() -> None:
    released = threading.Event()

    class HangingExporter(SpanExporter):
        def export(self, spans):
            released.wait(30)
            return SpanExportResult.SUCCESS

    try:
        assert _stop_time_s(Tracer("http://unused:1", "t", exporter=HangingExporter())) < SHUTDOWN_TIMEOUT_S + 0.5
    finally:
        released.set()

