"""The compute service's spans of each traced request (``--otlp-traces-endpoint``; docs/design.md, "Traces").

Per request, children of the caller's span (the gateway's ``gateway.backend_call``, from the
``traceparent`` of its ``Generate``; a request without one starts a trace):

    compute.generate   arrival at the engine loop ─────────────────────────────────▶ finish
      queue            arrival ──▶ admitted (the step that first gave it blocks)
      memory.step      (the memory service's, for each Step that allocates its blocks)
      prefill          admitted ──▶ first token   (prompt and cached token counts)
      decode           first token ──▶ finish     (output token count, finish reasons)

The phases are the ones the latency histograms observe (request_metrics.py), kept here only for
traced requests. ``compute.generate`` is opened at arrival (its id must travel to the memory
service before the request ends); the three phases are written when it finishes, from their times.
Decode is one span for the whole of it, never a span per token or per step. Every method runs on
the engine loop thread (the memory client's hook ``traceparent_of`` too: it is called inside a step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memory_service.api import AllocateOp, Op

from compute_service.engine.engine import Engine
from compute_service.engine.outputs import RequestDelta

if TYPE_CHECKING:
    from pagedserve.tracing import Span, Tracer


@dataclass
class _Request:
    span: Span
    traceparent: str  # of ``span``: what its Steps carry
    arrival: float
    seq_ids: list[str]
    admitted: float | None = None
    first_token: float | None = None
    finish_reasons: set[str] = field(default_factory=set)


class RequestSpans:
    """The spans of the requests that arrived with tracing on (all of them: a request without a
    traceparent gets a new trace), fed by the engine loop.

    Args:
        tracer: the service's tracer (pagedserve/tracing.py).
    """

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._requests: dict[str, _Request] = {}
        self._seq_requests: dict[str, _Request] = {}  # seq id -> its request, for its Steps' traceparent

    def arrived(self, engine: Engine, request_id: str, traceparent: str | None, arrival: float) -> None:
        """A request entered ``engine`` (``Engine.add`` done) at ``arrival`` (monotonic s)."""
        request = engine.requests[request_id]
        span = self.tracer.start("compute.generate", traceparent, kind="server", at=arrival, attributes={
            "pagedserve.request_id": request_id, "pagedserve.num_prompt_tokens": len(request.prompt_token_ids),
            "pagedserve.priority": request.priority, "pagedserve.n": request.params.n})
        traced = _Request(span, self.tracer.traceparent(span), arrival, [s.seq_id for s in request.seqs])
        self._requests[request_id] = traced
        for seq_id in traced.seq_ids:
            self._seq_requests[seq_id] = traced

    def traceparent_of(self, ops: Sequence[Op]) -> str | None:
        """The memory client's hook: the traceparent for a Step whose ops allocate a traced
        request's blocks (the first such request's), else None (the Step carries none)."""
        if not self._seq_requests:
            return None
        for op in ops:
            if isinstance(op, AllocateOp):
                traced = self._seq_requests.get(op.seq_id)
                if traced is not None:
                    return traced.traceparent
        return None

    def stepped(self, admitted: Iterable[str], step_start: float, outputs: Iterable[RequestDelta],
                now: float) -> None:
        """After one step that began at ``step_start`` and ended at ``now`` with ``outputs``, having
        admitted the requests ``admitted`` (``RequestTimes.stepped``'s answer: one scan for both)."""
        if not self._requests:
            return
        for request_id in admitted:
            traced = self._requests.get(request_id)
            if traced is not None:
                traced.admitted = step_start
        for out in outputs:
            traced = self._requests.get(out.request_id)
            if traced is None:
                continue
            if traced.first_token is None and any(c.token_ids for c in out.completions):
                traced.first_token = now
            traced.finish_reasons.update(c.finish_reason for c in out.completions if c.finish_reason)
            if out.finished:
                self._finish(out, traced, now)

    def forget(self, request_id: str, error: str) -> None:
        """A request left without a finished output (its engine failed or was lost): its span ends in error."""
        traced = self._pop(request_id)
        if traced is not None:
            self.tracer.end(traced.span, error=error)

    def forget_all(self, error: str) -> None:
        for request_id in list(self._requests):
            self.forget(request_id, error)

    def _finish(self, out: RequestDelta, traced: _Request, now: float) -> None:
        self._pop(out.request_id)
        tracer, span = self.tracer, traced.span
        if traced.admitted is not None:
            tracer.record("queue", span, traced.arrival, traced.admitted)
            prefill_end = traced.first_token if traced.first_token is not None else now
            tracer.record("prefill", span, traced.admitted, prefill_end, {
                "pagedserve.num_prompt_tokens": len(out.prompt_token_ids),
                "pagedserve.num_cached_tokens": out.num_cached_tokens})
        if traced.first_token is not None:
            tracer.record("decode", span, traced.first_token, now, {
                "pagedserve.num_output_tokens": out.num_completion_tokens,
                "pagedserve.finish_reasons": ",".join(sorted(traced.finish_reasons))})
        tracer.end(span, at=now, attributes={
            "pagedserve.num_cached_tokens": out.num_cached_tokens,
            "pagedserve.num_output_tokens": out.num_completion_tokens,
            "pagedserve.finish_reasons": ",".join(sorted(traced.finish_reasons))}, error=out.error)

    def _pop(self, request_id: str) -> _Request | None:
        traced = self._requests.pop(request_id, None)
        if traced is not None:
            for seq_id in traced.seq_ids:
                self._seq_requests.pop(seq_id, None)
        return traced
