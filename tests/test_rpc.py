"""The shared error interceptor and the asyncio server helper: status codes, and serving goes on."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import rpc, sockets
from pagedserve.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    InvalidArgument,
    PermissionDeniedError,
    PreconditionError,
    ResourceExhaustedError,
    UnavailableError,
    echo,
)

RAISES = {
    b"value": InvalidArgument("params.top_p must be in (0, 1], got 2.0"),
    b"bare_value": ValueError("a bug that happens to be a ValueError"),
    b"huge": InvalidArgument("x" * 100_000),
    b"late": DeadlineExceededError("deadline exceeded"),
    b"denied": PermissionDeniedError("priority above the tenant's maximum"),
    b"precondition": PreconditionError("layout differs"),
    b"exists": AlreadyExistsError("request_id 'a' is already running"),
    b"full": ResourceExhaustedError("queue is full (8 requests)"),
    b"down": UnavailableError("memory service unreachable"),
    b"bug": KeyError("a bug"),
}


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request in RAISES:
        raise RAISES[request]
    if request == b"abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "chosen by the servicer")
    return b"ok:" + request


async def _stream(request: bytes, context: grpc.aio.ServicerContext):
    yield b"first"
    if request in RAISES:
        raise RAISES[request]
    yield b"second"


def _register(server: grpc.aio.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))


async def _scenario() -> dict[str, object]:
    server, health = rpc.create_aio_server([_register], ["test.Echo"], serving=False)
    address = sockets.bind(server, "127.0.0.1:0")
    await server.start()
    seen: dict[str, object] = {}
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            seen["health_before"] = (await check(health_pb2.HealthCheckRequest(service="test.Echo"))).status
            await health.set_serving(True)
            seen["health_after"] = (await check(health_pb2.HealthCheckRequest(service=""))).status
            unary = channel.unary_unary("/test.Echo/Unary")
            for key in [*RAISES, b"abort"]:
                try:
                    await unary(key)
                except grpc.aio.AioRpcError as exc:
                    seen[key.decode()] = (exc.code(), exc.details())
            seen["still_serving"] = await unary(b"x")
            stream = channel.unary_stream("/test.Echo/Stream")
            got = []
            try:
                async for reply in stream(b"value"):
                    got.append(reply)
            except grpc.aio.AioRpcError as exc:
                seen["stream_error"] = (got, exc.code())
            seen["stream_ok"] = [r async for r in stream(b"x")]
    finally:
        await server.stop(None)
    return seen


def test_aio_server_maps_exceptions_and_keeps_serving() -> None:
    seen = asyncio.run(_scenario())
    assert seen["health_before"] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen["health_after"] == health_pb2.HealthCheckResponse.SERVING
    assert seen["value"] == (grpc.StatusCode.INVALID_ARGUMENT, "params.top_p must be in (0, 1], got 2.0")
    # Only InvalidArgument is bad input: a bare ValueError is a bug like any other.
    assert seen["bare_value"] == (grpc.StatusCode.INTERNAL, "internal error in /test.Echo/Unary: ValueError")
    # A huge message is cut (gRPC carries it in a header), so the real status still arrives.
    assert seen["huge"][0] == grpc.StatusCode.INVALID_ARGUMENT and len(seen["huge"][1]) == rpc.MAX_DETAILS_CHARS + 3
    assert seen["late"][0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen["denied"][0] == grpc.StatusCode.PERMISSION_DENIED
    assert seen["precondition"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert seen["exists"][0] == grpc.StatusCode.ALREADY_EXISTS
    assert seen["full"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert seen["down"][0] == grpc.StatusCode.UNAVAILABLE
    # A bug is INTERNAL (not UNKNOWN) and names no internals beyond the exception type.
    assert seen["bug"] == (grpc.StatusCode.INTERNAL, "internal error in /test.Echo/Unary: KeyError")
    assert seen["abort"] == (grpc.StatusCode.PERMISSION_DENIED, "chosen by the servicer")
    assert seen["still_serving"] == b"ok:x"
    assert seen["stream_error"] == ([b"first"], grpc.StatusCode.INVALID_ARGUMENT)
    assert seen["stream_ok"] == [b"first", b"second"]


@pytest.mark.parametrize(("exc", "code"), [
    (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError("x"), grpc.StatusCode.INTERNAL),
    (UnavailableError("x"), grpc.StatusCode.UNAVAILABLE),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_for(exc: Exception, code: grpc.StatusCode) -> None:
    assert rpc.status_for(exc) == code


def test_echo_cuts_long_values() -> None:
    assert echo("user") == "'user'"
    cut = echo("r" * 1_000_000)
    assert cut == repr("r" * 64) + "..." and len(cut) == 69
    assert echo(list(range(1000))).endswith("...") and len(echo(list(range(1000)))) == 67


async def _watch_scenario() -> list[int]:
    server, health = rpc.create_aio_server([_register], ["test.Echo"], serving=True)
    address = sockets.bind(server, "127.0.0.1:0")
    await server.start()
    statuses: list[int] = []
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="test.Echo"))
            async for reply in watch:
                statuses.append(reply.status)
                if len(statuses) == 1:
                    await health.set_serving(False)
                else:
                    break
            watch.cancel()
    finally:
        await server.stop(None)
    return statuses


def test_health_watch_streams_status_changes() -> None:
    """Watch is a coroutine handler that writes with context.write: the interceptor must await it."""
    assert asyncio.run(_watch_scenario()) == [
        health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING,
    ]
