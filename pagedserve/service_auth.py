"""A shared secret between the gateways and their compute services.

Why: the compute service trusts what it is sent (``cache_salt``, ``priority``, request ids that
``Abort`` acts on), because the gateway derives those from the caller's API key. So it must accept
calls from its gateways only. Each side reads the same token (a file mounted from a Kubernetes
Secret, or ``$PAGEDSERVE_COMPUTE_TOKEN``); the gateway sends it as ``authorization: Bearer TOKEN``
on every call to a backend, and the compute service's interceptor compares it in constant time and
answers UNAUTHENTICATED otherwise. Health stays open (the kubelet's gRPC probes and the gateways'
polls carry no token); reflection does not (the gateway never needs it; ``grpcurl -H
'authorization: Bearer TOKEN' ... list`` still works).
"""

from __future__ import annotations

import hmac
import os
import string
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import grpc

TOKEN_ENV = "PAGEDSERVE_COMPUTE_TOKEN"
# The memory service's own token (memory_service/service/trust.py): a different secret, since the
# gateways that hold the compute token never talk to the memory service.
MEMORY_TOKEN_ENV = "PAGEDSERVE_MEMORY_TOKEN"
# The gateway's API keys (gateway/config.py) and a client's own key (pagedserve_cli/cli.py).
API_KEYS_ENV = "PAGEDSERVE_API_KEYS"
API_KEY_ENV = "PAGEDSERVE_API_KEY"
# Which services may find each secret in their environment: a started service gets only its own
# (ServiceProcess), so a compute or memory service's /proc/PID/environ holds no API key.
SECRET_ENVS: dict[str, tuple[str, ...]] = {
    API_KEYS_ENV: ("gateway",),
    API_KEY_ENV: (),
    TOKEN_ENV: ("gateway", "compute_service"),
    MEMORY_TOKEN_ENV: ("compute_service", "memory_service"),
}
MIN_TOKEN_CHARS = 16


def env_for_service(module: str, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the secrets that the service ``module`` has no use for (``SECRET_ENVS``)."""
    return {name: value for name, value in env.items() if module in SECRET_ENVS.get(name, (module,))}
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)


def check_token(token: object, name: str) -> str:
    """``token`` if it is usable as a shared secret; ValueError naming ``name`` otherwise."""
    if not isinstance(token, str):
        raise ValueError(f"{name} must be a string, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_CHARS or not set(token) <= _TOKEN_CHARS:
        raise ValueError(f"{name} must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces")
    return token


def load_token(path: str | None, name: str, environ: Mapping[str, str] = os.environ,
               env: str = TOKEN_ENV) -> str | None:
    """The token in file ``path`` (surrounding whitespace dropped), else ``$env``
    (``$PAGEDSERVE_COMPUTE_TOKEN`` by default), else None (no authentication). Read at start, never at
    import time."""
    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{name} {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
        return check_token(token, f"{name} {path!r}: the token")
    token = environ.get(env, "").strip()
    return check_token(token, f"${env}") if token else None


def token_matches(offered: bytes, token: str) -> bool:
    """Whether ``offered`` (a call's Bearer token, see ``bearer_token``) is ``token``; in constant time
    (``hmac.compare_digest`` takes time independent of where the two differ, lengths aside)."""
    return hmac.compare_digest(offered, token.encode())


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    """The Bearer token of a call's metadata (b"" when there is none); the gateway's API keys and the
    service token are both read by it."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, rest = text.partition(" ")
            if scheme.lower() == "bearer":
                return rest.strip().encode("latin-1", errors="replace")
    return b""


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED (``rejection``) to every call whose Bearer token ``accepts`` refuses;
    methods under ``open_prefixes`` pass without one. The compute service's token check and the
    gateway's API-key check are the two kinds."""

    open_prefixes: tuple[str, ...] = _OPEN_PREFIXES
    rejection = "missing or invalid token"

    def accepts(self, offered: bytes) -> bool:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        offered = bearer_token(handler_call_details.invocation_metadata)
        if method.startswith(self.open_prefixes) or self.accepts(offered):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else rejecting_handler(handler, self.rejection)


class TokenInterceptor(BearerInterceptor):
    """Answers UNAUTHENTICATED to every call without the token (health exempt).

    Args:
        token: the shared secret (see ``check_token``).
    """

    rejection = "missing or invalid service token"

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def accepts(self, offered: bytes) -> bool:
        # compare_digest takes time independent of where the two differ (lengths aside).
        return hmac.compare_digest(offered, self._token)


def rejecting_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that only answers UNAUTHENTICATED with ``message`` (the
    request is never parsed); the gateway's API-key interceptor uses it too."""

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: object, context: grpc.aio.ServicerContext):
        await deny(request, context)
        yield  # an async generator, as a streaming handler must be

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, response_serializer=handler.response_serializer)
    if handler.stream_unary or handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(deny_stream, response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, response_serializer=handler.response_serializer)


class _TokenCallDetails:
    """Adds ``authorization: Bearer TOKEN`` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnaryToken(_TokenCallDetails, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStreamToken(_TokenCallDetails, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send ``token`` on every unary and server-streaming call of a channel.

    Two objects, not one class with both methods: grpc.aio files each interceptor under the first
    kind it is an instance of, so a combined one would never see the streaming calls.
    """
    return [_UnaryUnaryToken(token), _UnaryStreamToken(token)]
