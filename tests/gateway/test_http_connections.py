"""The HTTP front's connection guard in process: half-sent requests are closed at
their read deadline, a body that stops coming is answered 408, connections beyond the cap are
answered 503 at once, and the server keeps answering whole requests throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.openai_api.connections import BODY_TIMEOUT, EVICTED, HEADERS_TIMEOUT, OVER_CAPACITY
from gateway.openai_api.server import HttpServer
from pagedserve.process import async_wait_until
from tests.processes import lowered_open_files_limit

HALF_SENT = b"POST /echo HTTP/1.1\r\nHost: x\r\n"  # the headers never end


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


APP = Starlette(routes=[Route("/health", _health, methods=["GET"]), Route("/echo", _echo, methods=["POST"])])


async def _open(port: int, data: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (b"" if it sends nothing)."""
    return await asyncio.wait_for(reader.read(), timeout=30)


async def _get_health(port: int) -> bytes:
    reader, writer = await _open(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    try:
        return await _answer(reader)
    finally:
        writer.close()


def _serve(read_timeout_s: float, max_connections: int) -> Callable[[Callable[[HttpServer], Awaitable[None]]], None]:
    """Runs ``test(server)`` against a started HttpServer, stopping it afterwards."""
    def run(test: Callable[[HttpServer], Awaitable[None]]) -> None:
        async def main() -> None:
            server = HttpServer(APP, "127.0.0.1", 0, grace_period_s=1, read_timeout_s=read_timeout_s,
                                max_connections=max_connections)
            await server.start()
            try:
                await test(server)
            finally:
                await server.stop()
        asyncio.run(main())
    return run


def _connections(server: HttpServer) -> int:
    return len(server._server.server_state.connections)


def test_half_sent_requests_are_closed_at_the_deadline_and_whole_ones_answered() -> None:
    async def test(server: HttpServer) -> None:
        idle = [await _open(server.port, HALF_SENT) for _ in range(6)]
        silent = [await _open(server.port) for _ in range(2)]  # connected, never a byte
        answers = await asyncio.gather(*(_answer(reader) for reader, _ in idle + silent))
        assert answers == [b""] * 8  # closed by the server, nothing to answer
        assert server.guard.num_closed == {HEADERS_TIMEOUT: 8}
        assert (await _get_health(server.port)).startswith(b"HTTP/1.1 200")
        for _, writer in idle + silent:
            writer.close()
        await async_wait_until(lambda: _connections(server) == 0, 30, "every connection closed")

    _serve(read_timeout_s=0.5, max_connections=20)(test)


def test_a_body_that_stops_coming_is_answered_408() -> None:
    async def test(server: HttpServer) -> None:
        reader, writer = await _open(server.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                                  b"\r\nContent-Length: 100\r\n\r\n" + b"{" * 10)
        answer = await _answer(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"type": "invalid_request_error"' in answer
        assert server.guard.num_closed == {BODY_TIMEOUT: 1}
        # A whole request on a kept-alive connection is answered; then its idle wait ends too.
        reader, writer = await _open(server.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        answer = await _answer(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"size":3}')
        assert server.guard.num_closed == {BODY_TIMEOUT: 1, HEADERS_TIMEOUT: 1}

    _serve(read_timeout_s=0.5, max_connections=20)(test)


def test_a_connection_beyond_the_cap_takes_the_place_of_the_longest_waiting_for_headers() -> None:
    """Refusing new connections beyond the cap let half-sent requests, reopened as
    fast as they were closed, hold every place: /health and keyed requests got 503 for 30 s. Now the
    connection that has waited longest for its headers gives way, and the new client is served."""
    async def test(server: HttpServer) -> None:
        held = [await _open(server.port, HALF_SENT) for _ in range(3)]
        await async_wait_until(lambda: _connections(server) == 3, 30, "3 connections open")
        assert (await _get_health(server.port)).startswith(b"HTTP/1.1 200")
        assert await _answer(held[0][0]) == b""  # the oldest half-sent request: closed, nothing to answer
        assert server.guard.num_closed == {EVICTED: 1}
        for _, writer in held:
            writer.close()

    _serve(read_timeout_s=60, max_connections=3)(test)


def test_connections_beyond_the_cap_are_refused_when_every_place_has_a_request() -> None:
    async def test(server: HttpServer) -> None:
        # Headers whole, the body on its way: requests in progress, which never give way.
        busy = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        held = [await _open(server.port, busy) for _ in range(3)]
        await async_wait_until(lambda: _connections(server) == 3 and not server.guard.waiting, 30,
                               "3 requests in progress")
        reader, writer = await _open(server.port)
        refused = await _answer(reader)
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503 ") and b"too many open connections" in refused
        assert server.guard.num_closed == {OVER_CAPACITY: 1}
        held.pop()[1].close()  # a place frees up: the next client is served
        await async_wait_until(lambda: _connections(server) == 2, 30, "2 connections open")
        assert (await _get_health(server.port)).startswith(b"HTTP/1.1 200")
        for _, writer in held:
            writer.close()

    _serve(read_timeout_s=60, max_connections=3)(test)


@pytest.mark.parametrize("value", [0, -1])
def test_limits_are_checked(value: float) -> None:
    with pytest.raises(ValueError, match="read_timeout_s"):
        HttpServer(APP, "127.0.0.1", 0, 1, read_timeout_s=value)
    with pytest.raises(ValueError, match="max_connections"):
        HttpServer(APP, "127.0.0.1", 0, 1, max_connections=int(value))


def test_the_cap_is_kept_to_half_the_descriptor_limit() -> None:
    """Idle HTTP clients must never take the descriptors the gRPC front and the backends need."""
    with lowered_open_files_limit(256):
        assert HttpServer(APP, "127.0.0.1", 0, 1, max_connections=1024).guard.max_connections == 128
        assert HttpServer(APP, "127.0.0.1", 0, 1, max_connections=20).guard.max_connections == 20
