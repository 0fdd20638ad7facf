"""API-key auth for the gRPC front: ``authorization: Bearer KEY`` metadata names the tenant.

Which tenant a key is, and the constant-time match, live in ``gateway.tenants`` (shared with every
front); this interceptor only refuses calls whose key is no tenant's. Health checks and reflection
stay open, so load balancers, Kubernetes probes and ``grpcurl list`` work without a key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import grpc

from gateway.tenants import Tenants

_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    """The token of the call's ``authorization: Bearer TOKEN`` metadata (empty when none)."""
    token = b""
    for name, value in metadata or ():
        if name.lower() == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, rest = text.partition(" ")
            if scheme.lower() == "bearer":
                token = rest.strip().encode("latin-1", "replace")
    return token


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
        return _rejecting(handler)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only answers UNAUTHENTICATED."""

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer KEY)")

    async def deny_stream(request: object, context: grpc.aio.ServicerContext):
        await deny(request, context)
        yield  # an async generator, as a streaming handler must be

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
