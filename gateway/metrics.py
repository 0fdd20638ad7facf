"""Prometheus metrics of the gateway, in a registry of its own, served over HTTP on request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:  # the core imports these metrics: at run time they import no adapter
    from gateway.backend.routing import RouteDecision

# Latencies of an LLM: first tokens in tens of ms to seconds; tokens in a few to hundreds of ms.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class GatewayMetrics:
    """Requests by method and status, TTFT and time per output token, queue length, backend health."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pagedserve_gateway_requests", "Requests answered, by method and gRPC status.",
                                ["method", "status"], registry=self.registry)
        self.ttft = Histogram("pagedserve_gateway_time_to_first_token_seconds",
                              "From a request's arrival to its first generated token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pagedserve_gateway_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request.",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.queue_length = Gauge("pagedserve_gateway_queue_length",
                                  "Requests held by this gateway now (waiting for or streaming from a backend).",
                                  registry=self.registry)
        self.tenant_in_flight = Gauge("pagedserve_gateway_tenant_requests",
                                      "Requests each tenant holds in this gateway now (named, never keyed).",
                                      ["tenant"], registry=self.registry)
        self.tenant_waiting = Gauge("pagedserve_gateway_tenant_waiting_requests",
                                    "Requests of each tenant sent to a backend that has not answered their first "
                                    "token yet: queued there, behind the backend's fair admission (named, never "
                                    "keyed).", ["tenant"], registry=self.registry)
        self.write_stalls = Counter("pagedserve_gateway_write_stalls",
                                    "Streams ended because their client read nothing for write_stall_timeout_s.",
                                    registry=self.registry)
        self.http_connections_closed = Counter(
            "pagedserve_gateway_http_connections_closed",
            "HTTP connections the gateway closed itself, by reason: headers_timeout and body_timeout (the request "
            "did not arrive within http_read_timeout_s), over_capacity (http_max_connections were open).",
            ["reason"], registry=self.registry)
        self.backend_healthy = Gauge("pagedserve_gateway_backend_healthy",
                                     "1 while a backend is in rotation, 0 while it is out.",
                                     ["backend"], registry=self.registry)
        self.backend_outstanding = Gauge("pagedserve_gateway_backend_outstanding_requests",
                                         "This gateway's requests on each backend.",
                                         ["backend"], registry=self.registry)
        self.backend_pending_tokens = Gauge("pagedserve_gateway_backend_pending_tokens",
                                            "Tokens each backend reported still to compute (every gateway's "
                                            "requests), as of this gateway's last poll.",
                                            ["backend"], registry=self.registry)

        self.routing_decisions = Counter(
            "pagedserve_gateway_routing_decisions",
            "Requests routed, by backend and by what the backend's cache was predicted to hold of the prompt: "
            "pool (its leading blocks, in the memory service's pool), tier (some of them only in a tier below "
            "the pool), none. Backends attached to one memory service share its predictions.",
            ["backend", "prediction"], registry=self.registry)
        self.routing_predicted_blocks = Counter(
            "pagedserve_gateway_routing_predicted_blocks",
            "Prompt blocks predicted cached on the backend each request was routed to, by where: pool or tier.",
            ["where"], registry=self.registry)
        self.routing_affinity_yielded = Counter(
            "pagedserve_gateway_routing_affinity_yielded",
            "Requests not sent to the backend with the best predicted cache hit, because it was too loaded.",
            registry=self.registry)

    def routed(self, decision: RouteDecision) -> None:
        """The dispatcher's callback: one routing decision."""
        backend = getattr(decision.target, "address", "?")
        self.routing_decisions.labels(backend, decision.prediction).inc()
        self.routing_predicted_blocks.labels("pool").inc(decision.match.num_pool_blocks)
        self.routing_predicted_blocks.labels("tier").inc(decision.match.num_tier_blocks)
        if decision.yielded:
            self.routing_affinity_yielded.inc()

    def tenant_changed(self, tenant: str, num_requests: int) -> None:
        """``Tenants``' callback: a tenant's requests in flight changed."""
        self.tenant_in_flight.labels(tenant).set(num_requests)

    def http_connection_closed(self, reason: str) -> None:
        """The HTTP front's connection guard closed a connection (see gateway.openai_api.connections)."""
        self.http_connections_closed.labels(reason).inc()

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP endpoint (a daemon thread); returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
