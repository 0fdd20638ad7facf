"""The memory service's spans (``--otlp-traces-endpoint``; docs/design.md, "Traces").

A Step serves one engine step of one client, which may carry many requests. The compute service
sends a ``traceparent`` only on the Steps that try to allocate blocks for a traced request (its
admission, or its re-admission after a preemption; compute_service/service/request_traces.py), so a
span here is one request's ``memory.step``, a child of its ``compute.generate``; the Steps of plain
decode growth carry none and cost nothing here. The tier loads such a Step starts (its prefix found
in the host or disk tier) are its children, ``memory.tier_load``, written by the loader thread when
the load ends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.trace_context import traceparent_of

from memory_service.manager.tier_book import TierLoad

if TYPE_CHECKING:
    from pagedserve.tracing import Span, Tracer


@dataclass
class StepTrace:
    """One traced Step: its span, and where the tier loads it starts are noted."""

    span: Span
    _load_parents: dict[int, Span]
    num_loads: int = 0

    def started_loads(self, loads: list[TierLoad]) -> None:
        """Before the loads are submitted: a loader that ends one at once finds its parent."""
        for load in loads:
            self._load_parents[id(load)] = self.span
        self.num_loads += len(loads)


class StepTraces:
    """Spans of the Steps that carry a traceparent and of the tier loads they start.

    Args:
        tracer: the service's tracer (pagedserve/tracing.py).
    """

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._load_parents: dict[int, Span] = {}  # id(TierLoad) -> its Step's span, until the load ends

    @contextlib.contextmanager
    def step(self, metadata: Iterable[tuple[str, str | bytes]] | None, client_id: str,
             num_ops: int) -> Iterator[StepTrace | None]:
        """Around one Step: a ``memory.step`` span when the call carries a traceparent, else None."""
        parent = traceparent_of(metadata)
        if parent is None:
            yield None
            return
        trace = StepTrace(self.tracer.start("memory.step", parent, kind="server", attributes={
            "pagedserve.client_id": client_id, "pagedserve.num_ops": num_ops}), self._load_parents)
        error = None
        try:
            yield trace
        except BaseException as exc:  # re-raised: the span only says so
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.tracer.end(trace.span, attributes={"pagedserve.num_tier_loads": trace.num_loads}, error=error)

    def load_done(self, load: TierLoad, start: float, num_loaded: int, num_read: dict[str, int]) -> None:
        """The tier worker's hook (a loader thread), after each load: its span if a traced Step began it."""
        parent = self._load_parents.pop(id(load), None)
        if parent is None:
            return
        self.tracer.record("memory.tier_load", parent, start, time.monotonic(), {
            "pagedserve.seq_id": load.seq_id, "pagedserve.num_blocks": len(load.block_ids),
            "pagedserve.num_loaded_blocks": num_loaded,
            **{f"pagedserve.num_{kind}_blocks": n for kind, n in num_read.items()}})
