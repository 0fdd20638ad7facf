"""How the HTTP front's answers travel: the race against a client's disconnect, and the SSE stream
with its write-stall timeout.

A client that disconnects aborts its request: the handler races the work against the ASGI
``http.disconnect`` message (awaiting it directly, since ``request.is_disconnected()`` does not see
it behind middleware, as vLLM found), and cancelling the work closes the backend call, which frees
the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.core.streaming import collect, send_within
from gateway.core.types import Delta, Reply

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def whole_answers(receive: Receive, streams: list[tuple[str, AsyncIterator[Delta]]]) -> list[Reply]:
    """Each request's whole answer (``collect``), run together and raced against a disconnect: one
    failing cancels the others (aborting them), and its error is raised as it is.

    Args:
        streams: (request id, its deltas) per request.
    """
    async def whole() -> list[Reply]:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(request_id, deltas)) for request_id, deltas in streams]
        return [t.result() for t in tasks]

    try:
        return await until_disconnect(receive, whole())
    except ExceptionGroup as group:
        raise group.exceptions[0] from None


async def first_piece(receive: Receive, stream: AsyncIterator[T]) -> T:
    """A stream's first piece, raced against a disconnect (``until_disconnect``); the stream is
    closed (its requests aborted) when that fails. The response starts (200) only after it, so every
    failure before it is a real status."""
    try:
        return await until_disconnect(receive, anext(stream))
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise


class EventStream(StreamingResponse):
    """An SSE response that stops (closing its generator, so aborting the request) on disconnect,
    and when its client reads nothing for the write-stall timeout.

    Starlette watches for the disconnect only under ASGI specs before 2.4; a stream that is silent
    while its request queues must notice it too, so this one always races the two. A client that
    stays connected but reads nothing fills its socket buffers, and then uvicorn's ``send`` waits:
    each send gets ``stall_timeout_s`` (the gRPC front's ``write_stall_timeout_s``), after which
    ``on_stall`` is told and the stream ends (its requests aborted, their slots freed).

    Args:
        content: the SSE text.
        stall_timeout_s: how long one send may wait.
        on_stall: called once when a send waited that long.
        on_close: called when the response is over, however it ended (releases what it holds).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], stall_timeout_s: float, on_stall: Callable[[], None],
                 on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self.stall_timeout_s, self.on_stall, self.on_close = stall_timeout_s, on_stall, on_close

    async def stream_response(self, send: Send) -> None:
        """Starlette's, with each send given ``stall_timeout_s``."""
        async with contextlib.aclosing(self._messages()) as messages:
            async for message in messages:
                if not await send_within(send(message), self.stall_timeout_s):
                    self.on_stall()
                    return  # the response is left incomplete: uvicorn closes the connection

    async def _messages(self) -> AsyncIterator[dict]:
        yield {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        async for chunk in self.body_iterator:
            body = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
            yield {"type": "http.response.body", "body": body, "more_body": True}
        yield {"type": "http.response.body", "body": b"", "more_body": False}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _disconnected(receive)
                group.cancel_scope.cancel()
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()
