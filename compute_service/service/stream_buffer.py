"""The bounded hand-off from the engine thread to one Generate stream.

Why bounded, and how: the engine produces one output per step whatever the client does, and the
stream's handler can only pass them on as fast as the client reads (gRPC's flow control blocks its
writes). An unbounded queue between the two let a client that never reads pin memory without end.
So the engine thread counts what it puts in: when ``max_items`` outputs wait, ``put`` says "full"
and the engine loop pauses the request (it keeps its blocks but gets no more steps); when the
handler has taken the queue down to half, it asks the loop to resume it. Pausing happens on the
engine thread right after the ``put`` that filled the queue, and the resume command can only be
sent after that ``put`` (it needs the paused flag it set), so no resume is ever lost and the queue
never holds more than ``max_items`` outputs plus the request's final one (an abort or an error).
A client that does not read at all is the handler's business: its write-stall timeout aborts it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class StreamBuffer(Generic[T]):
    """Items from the engine thread (``put``) to one asyncio handler (``get``).

    Args:
        event_loop: the handler's loop.
        max_items: items waiting before ``put`` reports the buffer full (>= 2).
        on_resume: called on the event loop once a full buffer is down to half (resume the request).
    """

    def __init__(self, event_loop: asyncio.AbstractEventLoop, max_items: int, on_resume: Callable[[], None]) -> None:
        if max_items < 2:
            raise ValueError(f"max_items must be >= 2, got {max_items}")
        self.max_items = max_items
        self._event_loop = event_loop
        self._on_resume = on_resume
        self._queue: asyncio.Queue[T] = asyncio.Queue()  # bounded by the protocol above, not by asyncio
        self._lock = threading.Lock()
        self._num_items = 0  # put and not yet taken (some may still be on their way to the loop)
        self.is_full = False  # put reported full; cleared when the handler resumes the request

    @property
    def num_items(self) -> int:
        return self._num_items

    def put(self, item: T) -> bool:
        """Engine thread: hand ``item`` over; returns False when the request must pause."""
        with self._lock:
            self._num_items += 1
            has_room = self._num_items < self.max_items
            if not has_room:
                self.is_full = True
        try:
            self._event_loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed (process exit): no stream is left to tell
        return has_room

    async def get(self) -> T:
        """Handler: the next item; resumes a paused request once half the buffer is free."""
        item = await self._queue.get()
        with self._lock:
            self._num_items -= 1
            resume = self.is_full and self._num_items <= self.max_items // 2
            if resume:
                self.is_full = False
        if resume:
            self._on_resume()
        return item
