"""Traces over OTLP (``--otlp-traces-endpoint``, every service): W3C trace context in, spans out.

One trace from the client to the KV pool (docs/design.md, "Traces"): a front takes the client's
``traceparent`` (gRPC metadata or HTTP header; none or a malformed one starts a new trace), and each
hop passes its own span's ``traceparent`` on in the gRPC metadata of the call it makes (gateway ->
compute ``Generate``, compute -> memory ``Step``).

Why a module that only a service with the flag imports (``pagedserve.trace_context`` is what the
others hold: nothing): the OpenTelemetry SDK and its OTLP exporter take ~0.1 s to import and start a
thread; a service without the flag must not pay that, and its request paths test one ``None``
(``tracer is None``) per request, no more.

Why spans are mostly written after the fact (``record``): the engine loop knows a request's phases
(queued, prefilled, decoding) only as times it already keeps for its histograms; a span per phase is
made once, when the request finishes, from those times, so no span is open across steps and nothing
is done per token. Times here are ``time.monotonic()`` seconds, turned into the wall clock by one
offset per process (``_offset_ns``), so that the spans of a process never disagree on order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pagedserve.trace_context import TRACEPARENT

__all__ = ["TRACEPARENT", "Span", "Tracer"]

Attributes = Mapping[str, str | int | float | bool]
Parent = Span | str | None  # a span of ours, a traceparent header's value, or None (a new trace)
# Why short bounds: the services' stops are bounded (pagedserve/drain.py, 5 s), and a collector that
# is down must not hold one past them (the SDK's defaults, 10 s per export with retries and 30 s for
# a shutdown, would). An export gives up after EXPORT_TIMEOUT_S (spans lost, as a full queue would
# lose them); ``shutdown`` returns after SHUTDOWN_TIMEOUT_S whatever the exporter does, leaving the
# flush on a daemon thread that the process exit ends.
EXPORT_TIMEOUT_S = 1.0
SHUTDOWN_TIMEOUT_S = 2.0


class Tracer:
    """One service's spans, batched to an OTLP/gRPC collector on a thread of the SDK's.

    Args:
        endpoint: the collector, ``http://HOST:PORT`` (plain) or ``https://HOST:PORT`` (TLS).
        service_name: the resource's ``service.name`` (``pagedserve-gateway``, ...).
        exporter: another exporter (tests); default OTLP over gRPC to ``endpoint``.
    """

    def __init__(self, endpoint: str, service_name: str, exporter: SpanExporter | None = None) -> None:
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme == "http",
                                        timeout=EXPORT_TIMEOUT_S)
        # A provider of our own, not the global one: nothing else in the process (a library that
        # traces through the global API) sends spans to the operator's collector unasked.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        # OTEL_BSP_* tune its batches; the export timeout is ours (above).
        self._provider.add_span_processor(BatchSpanProcessor(exporter,
                                                             export_timeout_millis=EXPORT_TIMEOUT_S * 1000))
        self._tracer = self._provider.get_tracer("pagedserve")
        self._propagator = TraceContextTextMapPropagator()
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def start(self, name: str, parent: Parent, *, kind: str = "internal", at: float | None = None,
              attributes: Attributes | None = None) -> Span:
        """An open span (end it with ``end``), child of ``parent``; ``at``: its start (monotonic s), else now.
        ``kind``: "server", "client" or "internal" (a string: callers need not import OpenTelemetry)."""
        start = self.wall_ns(time.monotonic() if at is None else at)
        return self._tracer.start_span(name, context=self._context(parent), kind=SpanKind[kind.upper()],
                                       attributes=attributes, start_time=start)

    def end(self, span: Span, *, at: float | None = None, attributes: Attributes | None = None,
            error: str | None = None) -> None:
        """Ends ``span`` (``at``: monotonic s, else now), with more attributes, in error with ``error``."""
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.wall_ns(time.monotonic() if at is None else at))

    def record(self, name: str, parent: Parent, start: float, end: float, attributes: Attributes | None = None,
               *, kind: str = "internal") -> Span:
        """A span that is over already, from ``start`` to ``end`` (monotonic s)."""
        span = self.start(name, parent, kind=kind, at=start, attributes=attributes)
        span.end(end_time=self.wall_ns(end))
        return span

    def traceparent(self, span: Span) -> str:
        """``span``'s W3C ``traceparent`` header value, for the metadata of the call it makes."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span, Context()))
        return carrier.get(TRACEPARENT, "")

    def wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def shutdown(self) -> None:
        """Sends what is still batched and stops the SDK's thread; returns within ``SHUTDOWN_TIMEOUT_S``.

        The rest of a flush past that (a collector that does not answer) goes on on a daemon thread.
        """
        flush = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        flush.start()
        flush.join(SHUTDOWN_TIMEOUT_S)

    def _context(self, parent: Parent) -> Context:
        # Always an explicit context: the SDK would otherwise take the current one (contextvars),
        # which may hold whatever span another library opened on this task.
        if parent is None:
            return Context()
        if isinstance(parent, str):  # a malformed header extracts to an empty context: a new trace
            return self._propagator.extract({TRACEPARENT: parent}, context=Context())
        return trace.set_span_in_context(parent, Context())
