"""Optional API-key auth: ``authorization: Bearer KEY`` metadata, compared in constant time.

Health checks and reflection stay open, so load balancers, Kubernetes probes and ``grpcurl list``
work without a key.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence

import grpc

_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def is_authorized(metadata: Sequence[tuple[str, str | bytes]], keys: Sequence[bytes]) -> bool:
    """Whether the call's metadata carries one of ``keys`` as a Bearer token.

    Every key is compared (no early exit), each with ``hmac.compare_digest``, so the time taken
    does not tell how much of a guess was right nor which key it was close to.
    """
    token = b""
    for name, value in metadata:
        if name.lower() == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, rest = text.partition(" ")
            if scheme.lower() == "bearer":
                token = rest.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched and bool(token)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid key with UNAUTHENTICATED (health and reflection exempt).

    Args:
        keys: the accepted API keys (non-empty).
    """

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [k.encode() for k in keys]

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(_OPEN_PREFIXES) or is_authorized(handler_call_details.invocation_metadata or (), self._keys):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _rejecting(handler)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only answers UNAUTHENTICATED."""

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer KEY)")

    async def deny_stream(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202
        await deny(request, context)
        yield  # an async generator, as a streaming handler must be

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
