"""gRPC plumbing shared by the servers: error mapping, health, reflection, socket addresses."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.errors import PreconditionError
from pagedserve.log import get_logger

log = get_logger("rpc")


def _status_for(exc: Exception) -> grpc.StatusCode | None:
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, PreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return None


def _wrap_unary(behavior: Callable, method: str) -> Callable:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except (ValueError, PreconditionError) as exc:
            context.abort(_status_for(exc), str(exc))

    return handler


def _wrap_stream(behavior: Callable, method: str) -> Callable:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            yield from behavior(request, context)
        except (ValueError, PreconditionError) as exc:
            context.abort(_status_for(exc), str(exc))

    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps ValueError to INVALID_ARGUMENT and PreconditionError to FAILED_PRECONDITION, in one place.

    Servicers raise; they never build status codes for bad input themselves."""

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        return handler


def create_server(
    register: Iterable[Callable[[grpc.Server], None]],
    service_names: Iterable[str],
    *,
    max_workers: int = 16,
) -> tuple[grpc.Server, health.HealthServicer]:
    """A gRPC server with our servicers, the error interceptor, grpc.health.v1 and reflection.

    Args:
        register: callables that add one servicer each (``lambda s: add_XServicer_to_server(x, s)``).
        service_names: full names of those services, for health and reflection.
    Returns:
        The (not yet started) server and its health servicer, set to SERVING for every service.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[ErrorInterceptor()],
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
    )
    for add in register:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in [*names, ""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, health_servicer


def bind(server: grpc.Server, address: str) -> str:
    """Bind ``address`` ("unix:/path/to.sock" or "host:port") and return the bound address.

    A Unix socket's directory is created private to the owner (0700) when it does not exist, and
    the socket file itself is made 0600 once the server has started (see ``secure_socket``).
    """
    if address.startswith("unix:"):
        path = Path(address[len("unix:"):])
        if path.parent != Path("/") and not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700)
        if path.exists():
            path.unlink()  # a stale socket of a previous run; binding would fail otherwise
        server.add_insecure_port(address)
        return address
    port = server.add_insecure_port(address)
    if port == 0:
        raise ValueError(f"cannot bind address {address!r}")
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"


def secure_socket(address: str) -> None:
    """chmod 0600 the socket file of a started server bound to a unix: address."""
    if address.startswith("unix:"):
        os.chmod(address[len("unix:"):], 0o600)


def default_socket_path() -> str:
    """Per-user private directory for the memory service's socket."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/pagedserve-{os.getuid()}"
    return str(Path(runtime) / "memory.sock")
