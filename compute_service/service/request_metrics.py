"""Per-request latency histograms of the compute service, observed on the engine loop thread.

The phases of one request, each a histogram (seconds), named as vLLM names its own so that the
dashboards and alerts users already have need only the prefix changed (docs/design.md, "Metrics for
routers"):

    arrival ──queue──▶ admitted ──prefill──▶ first token ──inter-token──▶ ... ──▶ finished
    └────────────────────────── time to first token ─┘                              │
    └──────────────────────────────────── end to end ───────────────────────────────┘

- arrival: the servicer handed the request to the engine loop (``EngineLoop.submit``);
- admitted: the start of the step whose admission gave the request's first sequence its blocks
  (a preempted request that is admitted again does not count twice);
- first token, inter-token: the end of each step whose output carries new tokens of the request
  (a step that accepts speculative drafts hands out several tokens at once: one gap, as vLLM counts
  an iteration);
- finished: the end of the step that finished it, whatever the reason.

Observed where the engine thread already is: after each step, a look at the requests not admitted
yet (at most the queue, ``max_queued_requests``) and at that step's outputs.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram

from compute_service.engine.engine import Engine
from compute_service.engine.outputs import RequestDelta

# From the tens of milliseconds of a cached prompt to the minutes of a long queue on a CPU.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5)


class RequestTimes:
    """The request latency histograms, fed by the engine loop thread; a metrics server exports them
    (``register``). Every method is called on the engine loop thread."""

    def __init__(self) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagedserve_compute_{name}_seconds", doc, buckets=buckets, registry=None)

        self.time_to_first_token = histogram("time_to_first_token", "From a request's arrival at the engine to its "
                                             "first generated token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency", "Between two outputs of a request that carry "
                                             "new tokens (one per engine step).", _TOKEN_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency", "From a request's arrival at the engine to its "
                                             "finish (any reason).", _LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time", "From a request's arrival at the engine to the "
                                            "step that first admitted it (gave it blocks).", _LATENCY_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time", "From a request's admission to its first "
                                              "generated token (its prompt's chunks computed).", _LATENCY_BUCKETS)
        self._arrivals: dict[str, float] = {}  # every request in the engine, by id
        self._queued: set[str] = set()  # not admitted yet
        self._admissions: dict[str, float] = {}  # admitted, no token yet
        self._last_tokens: dict[str, float] = {}  # when its latest tokens came out

    def register(self, registry: CollectorRegistry) -> None:
        for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                          self.request_queue_time, self.request_prefill_time):
            registry.register(histogram)

    def arrived(self, request_id: str, now: float) -> None:
        """A request entered the engine (its id is unique among the running ones)."""
        self._arrivals[request_id] = now
        self._queued.add(request_id)

    def stepped(self, engine: Engine, step_start: float, outputs: Iterable[RequestDelta], now: float) -> list[str]:
        """After one step that began at ``step_start`` and ended at ``now`` with ``outputs``; returns the
        requests that step admitted (first given blocks: the traces' queue ends there too)."""
        admitted = [r for r in self._queued if is_admitted(engine, r)]
        for request_id in admitted:
            self._queued.discard(request_id)
            self._admissions[request_id] = step_start
            self.request_queue_time.observe(step_start - self._arrivals[request_id])
        for out in outputs:
            request_id = out.request_id
            if request_id not in self._arrivals:
                continue  # the loop's own warm-up request
            if any(c.token_ids for c in out.completions):
                last = self._last_tokens.get(request_id)
                if last is None:
                    self.time_to_first_token.observe(now - self._arrivals[request_id])
                    admitted_at = self._admissions.pop(request_id, None)
                    if admitted_at is not None:
                        self.request_prefill_time.observe(now - admitted_at)
                else:
                    self.inter_token_latency.observe(now - last)
                self._last_tokens[request_id] = now
            if out.finished:
                self.e2e_request_latency.observe(now - self._arrivals[request_id])
                self.forget(request_id)
        return admitted

    def forget(self, request_id: str) -> None:
        """A request left without a finished output (its engine failed or was lost): no figures."""
        self._arrivals.pop(request_id, None)
        self._queued.discard(request_id)
        self._admissions.pop(request_id, None)
        self._last_tokens.pop(request_id, None)

    def forget_all(self) -> None:
        for request_id in list(self._arrivals):
            self.forget(request_id)


def is_admitted(engine: Engine, request_id: str) -> bool:
    """Whether the request holds blocks (its first sequence was admitted)."""
    request = engine.requests.get(request_id)
    return request is not None and any(seq.block_table for seq in request.seqs)
