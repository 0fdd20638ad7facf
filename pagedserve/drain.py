"""Graceful drain: how long a service may take to exit after SIGTERM, which the Helm chart's grace
periods are derived from (helm/pagedserve/templates/_helpers.tpl, ``pagedserve.drainGrace``).

On SIGTERM a service turns NOT_SERVING at once (readiness fails first: load balancers, our gateways
and an InferencePool's endpoint picker stop sending), refuses new requests with UNAVAILABLE naming
the shutdown, lets the requests in flight finish within its drain timeout (the compute service's
``--shutdown-grace-s``, the gateway's ``--drain-delay-s`` plus ``--grace-period-s``, the memory
service's ``--drain-timeout-s`` for its clients' requests), ends those still running, and exits.
After the drain timeout, each service stops within its ``*_STOP_S`` below, so it has exited
``drain timeout + *_STOP_S`` seconds after the signal at the latest; the tests of the drain measure
that bound on real processes (tests/compute_service/test_service_drain.py,
tests/e2e/test_gateway_guard.py, tests/memory_service/test_service_drain.py, and ``pagedserve up``'s,
which drains the three in turn: tests/test_cli.py).

In a pod, Kubernetes first runs the preStop hook (a sleep: the pod leaves its Services' endpoints and
the routers' lists while it still serves everything), then sends SIGTERM; the pod's
``terminationGracePeriodSeconds`` is preStop + drain timeout + the stop times of its containers
(the engine pod's memory sidecar stops after the compute container). tests/helm checks the rendered
chart against these constants.
"""

from __future__ import annotations

# The compute service after its drain: the gRPC server's stop (1 s), the engine loop's detach from the
# memory service (its thread ends between two steps), the grammar compiler's worker processes.
COMPUTE_STOP_S = 5
# The gateway after its grace period: both fronts closed, its backend channels and the core.
GATEWAY_STOP_S = 5
# The memory service after its drain (``--drain-timeout-s``: its clients' requests in flight finish; in a
# pod it is signalled after the compute container exited, so none is left): the gRPC server's stop (1 s),
# the KV tier's writes of what is not on disk yet (2 s at most: docs/design.md, "KV tiers"), the KV-event
# publisher's last flush (its thread and socket linger) and the tracer's (2 s at most), then the pool is
# freed: up to ~8 s when every one of them takes its bound.
MEMORY_STOP_S = 10

_STOP_S = {"gateway": GATEWAY_STOP_S, "compute_service": COMPUTE_STOP_S, "memory_service": MEMORY_STOP_S}


def stop_bound_s(module: str, drain_timeout_s: float) -> float:
    """How long after its SIGTERM the service ``module`` ("gateway", "compute_service",
    "memory_service") has exited at the latest, given its drain timeout: what ``pagedserve up`` waits
    before it kills one."""
    return drain_timeout_s + _STOP_S[module]
