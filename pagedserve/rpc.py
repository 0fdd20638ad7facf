"""gRPC plumbing shared by the servers (all grpc.aio): error mapping, health, reflection, creation.

Servicers raise the exceptions of ``pagedserve.errors`` (``InvalidArgument`` for bad input); the
interceptor below turns them into status codes in one place. Anything else, a bare ``ValueError``
included, is a bug: it is logged with its traceback and answered INTERNAL, and the server keeps
serving.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    InvalidArgument,
    PermissionDeniedError,
    PreconditionError,
    RequestFailedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from pagedserve.health import HealthServicer, is_ended_call_error
from pagedserve.log import get_logger

log = get_logger("rpc")

# 64 MiB: a step of thousands of sequences or a tokenizer chunk fits; far larger is a bad request.
MAX_MESSAGE_BYTES = 64 << 20

_STATUS_FOR_EXCEPTION: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    PreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    RequestFailedError: grpc.StatusCode.INTERNAL,  # expected: logged (with its traceback) where it failed
}
# Longest status message sent. gRPC carries it in a header (8 KiB of metadata by default); one
# beyond the limit reaches the client as RESOURCE_EXHAUSTED instead of the real status. Messages
# echo values through ``errors.echo`` already; this is the backstop for the rest.
MAX_DETAILS_CHARS = 1024


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code that answers ``exc``: its mapped code, or INTERNAL for a bug."""
    for kind, code in _STATUS_FOR_EXCEPTION.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _describe(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, RequestFailedError):
        log.error("rpc_internal_error", method=method, error=repr(exc), exc_info=exc)
        return code, f"internal error in {method}: {type(exc).__name__}"
    details = str(exc)
    if len(details) > MAX_DETAILS_CHARS:
        details = details[:MAX_DETAILS_CHARS] + "..."
    return code, details


def _parse(deserializer: Callable | None, data: Any) -> Any:
    """The request message of ``data``; a malformed one is bad input (``InvalidArgument``).

    Why not leave it to grpc: a request that fails to parse (truncated, a wrong wire type, invalid
    UTF-8 in a string field) is answered UNKNOWN by grpc.aio, a code that says "the server is
    broken" when the caller is. So the handlers get the raw bytes and parse them here, inside the
    error mapping.
    """
    if deserializer is None:
        return data
    try:
        return deserializer(data)
    except Exception as exc:  # protobuf's DecodeError, or whatever a custom parser raises
        raise InvalidArgument(f"request: not a valid message ({type(exc).__name__})") from None


def _wrap_aio_unary(behavior: Callable, method: str) -> Callable:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise  # context.abort() already chose the status
        except Exception as exc:  # mapped, and bugs are logged with a traceback
            await context.abort(*_describe(exc, method))

    return handler


def _wrap_aio_stream(behavior: Callable, method: str) -> Callable:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            replies = behavior(request, context)
            if hasattr(replies, "__aiter__"):
                async for reply in replies:
                    yield reply
            else:
                # A streaming handler may also be a coroutine that sends with ``context.write``
                # (the health service's Watch does): await it rather than iterate it.
                await replies
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            if is_ended_call_error(exc, context):  # a write that the client's cancel interrupted: no one to answer
                log.debug("rpc_cancelled_during_write", method=method, error=type(exc).__name__)
                return
            await context.abort(*_describe(exc, method))

    return handler


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes for a grpc.aio server (see the module docstring)."""

    async def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse = handler.request_deserializer  # requests are parsed inside the mapping: see _parse
        if handler.unary_unary:
            behavior = handler.unary_unary
            return handler._replace(request_deserializer=None, unary_unary=_wrap_aio_unary(
                lambda data, context: behavior(_parse(parse, data), context), method))
        if handler.unary_stream:
            stream = handler.unary_stream
            return handler._replace(request_deserializer=None, unary_stream=_wrap_aio_stream(
                lambda data, context: stream(_parse(parse, data), context), method))
        return handler


class AioHealth:
    """The grpc.health.v1 state of an asyncio server: one switch for every service it serves."""

    def __init__(self, servicer: HealthServicer, service_names: list[str]) -> None:
        self.servicer = servicer
        self.service_names = service_names
        self.is_serving = False

    async def set_serving(self, serving: bool) -> None:
        """SERVING or NOT_SERVING for the overall server ("") and every named service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.is_serving = serving
        for name in [*self.service_names, ""]:
            await self.servicer.set(name, status)

    async def shut_down(self) -> None:
        """NOT_SERVING for good: later set_serving calls are ignored (graceful shutdown)."""
        self.is_serving = False
        await self.servicer.enter_graceful_shutdown()


def create_aio_server(
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
    *,
    serving: bool = True,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    extra_interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, AioHealth]:
    """A grpc.aio server with our servicers, the error interceptor, health and reflection.

    Must be called with an event loop running (inside ``async def main``).

    Args:
        register: callables that add one servicer each.
        service_names: full names of those services, for health and reflection.
        serving: the initial health status. A service that must load something first starts
            NOT_SERVING and calls ``await health.set_serving(True)`` when ready.
        max_message_bytes: largest request or reply accepted.
        extra_interceptors: run before the error interceptor (auth, for example).
    Returns:
        The (not yet started) server and its health switch. Initial statuses are set before the
        server starts, so no probe ever sees an unknown service.
    """
    server = grpc.aio.server(
        interceptors=[*extra_interceptors, AioErrorInterceptor()],
        options=_message_options(max_message_bytes),
    )
    for add in register:
        add(server)
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names)
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in [*names, ""]:
        servicer._server_status[name] = status  # no watcher exists before start: set synchronously
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    state = AioHealth(servicer, names)
    state.is_serving = serving
    return server, state


def _message_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]

