"""API-key auth for the gRPC front: ``authorization: Bearer KEY`` metadata names the tenant.

Which tenant a key is, and the constant-time match, live in ``gateway.tenants`` (shared with every
front); this interceptor only refuses calls whose key is no tenant's. Health checks and reflection
stay open, so load balancers, Kubernetes probes and ``grpcurl list`` work without a key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from gateway.tenants import Tenants
from pagedserve.service_auth import bearer_token, rejecting_handler

__all__ = ["ApiKeyInterceptor", "bearer_token"]

_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a tenant's key with UNAUTHENTICATED (health and reflection exempt).

    Args:
        tenants: the gateway's tenants (with keys).
    """

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(_OPEN_PREFIXES) or self._tenants.identify(
                bearer_token(handler_call_details.invocation_metadata)) is not None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return rejecting_handler(handler, "missing or invalid API key (authorization: Bearer KEY)")
