"""The HTTP front's connection guard: read deadlines and a cap on open connections.

uvicorn (0.54) has neither. Its keep-alive timer runs only after a response, so a client that
connects and sends half a request (``POST / HTTP/1.1\\r\\nHost: x\\r\\n`` and nothing more), or
headers and then a body at a trickle, holds a descriptor and a place in its connection set for as
long as it likes; and ``limit_concurrency`` answers 503 only once a request's headers have
arrived, which an idle client never lets happen. 1,100 such connections exhausted a
1024-descriptor limit and both fronts (one process, one event loop) stopped answering.

``GuardedH11Protocol`` is uvicorn's own h11 protocol with the two guards added:

- a read deadline per phase: a request's headers must be complete ``read_timeout_s`` after the
  connection opened (or after the previous response, on a kept-alive connection), and its body
  ``read_timeout_s`` after its headers. Late headers: the connection is closed (there is no
  request to answer yet; nginx does the same). A late body: 408 with an OpenAI error object, then
  closed; the handler, which was waiting for the body, sees the client gone.
- a cap: a connection beyond ``max_connections`` open ones takes the place of the one that has
  waited longest for its headers (closed, nothing to answer), or, when every open connection has
  its request, is answered 503 and closed at once. With the deadline, a flood of idle clients
  holds at most ``max_connections`` descriptors for at most ``read_timeout_s``.

Why evict rather than refuse: refusing, 1,100 half-sent requests reopened as fast as they were
closed held every place, and for 30 s ``/health`` and keyed completions got 503 too: a client
without a key could starve the keyed ones. A real client sends its headers within
milliseconds of connecting, so it is past the eviction window before a flood can reach it, and the
connections that carry requests are never the ones closed.

Why deadlines per phase rather than on each read: a client that sends one byte every few seconds
must not keep its connection forever, which a per-read idle timeout would allow.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

# Why a connection was closed by the guard (the keys of ConnectionGuard.num_closed).
HEADERS_TIMEOUT, BODY_TIMEOUT, OVER_CAPACITY = "headers_timeout", "body_timeout", "over_capacity"
EVICTED = "evicted_waiting_for_headers"


@dataclass
class ConnectionGuard:
    """The limits of one HTTP server's connections, and how many each one closed.

    Args:
        read_timeout_s: the time a request's headers, then its body, may each take to arrive.
        max_connections: connections open at once; one more is answered 503 and closed.
        on_closed: called with the reason of each connection the guard closes (a metric).
    """

    read_timeout_s: float
    max_connections: int
    on_closed: Callable[[str], None] | None = None
    num_closed: Counter[str] = field(default_factory=Counter)
    # The connections waiting for a request's headers, longest-waiting first (dicts keep order), and
    # those evicted but not gone yet (they still count among uvicorn's connections until then).
    waiting: dict[GuardedH11Protocol, None] = field(default_factory=dict, repr=False)
    evicting: set[GuardedH11Protocol] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s!r}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")

    def closed(self, reason: str) -> None:
        self.num_closed[reason] += 1
        if self.on_closed is not None:
            self.on_closed(reason)


def _error_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error object, closing the connection.

    Written straight to the transport: h11 has no request to answer (over capacity), or the
    application's handler owns the response and never started it (body timeout).
    """
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ``ConnectionGuard`` (see the module docstring).

    The deadline has three states: waiting for headers (armed when the connection opens and when
    a response completes), waiting for a body (armed when headers arrive with a body to follow),
    and none (the request is read; the handler has it, however long it takes to answer).
    """

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # HEADERS_TIMEOUT, BODY_TIMEOUT or None
        self._request_cycle: object = None  # the request the deadline has seen (uvicorn's cycle)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) - len(self.guard.evicting) > self.guard.max_connections:
            oldest = next(iter(self.guard.waiting), None)
            if oldest is None:  # every open connection has its request: nothing to give way
                self.guard.closed(OVER_CAPACITY)
                transport.write(_error_response(503, "Service Unavailable", "too many open connections; retry later"))
                transport.close()
                return
            oldest._evict()
        self._arm(HEADERS_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.evicting.discard(self)
        super().connection_lost(exc)

    def _evict(self) -> None:
        """Gives this connection's place to a new one: it has no request yet, so nothing to answer."""
        self._disarm()
        self.guard.evicting.add(self)
        self.guard.closed(EVICTED)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        self._follow_request()

    def _follow_request(self) -> None:
        """Moves the deadline along with the request: headers, then body, then none."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # between requests: the next headers are due
            if self._waiting_for != HEADERS_TIMEOUT:
                self._arm(HEADERS_TIMEOUT)
        elif cycle is not self._request_cycle:  # a new request's headers arrived
            self._request_cycle = cycle
            if cycle.more_body:
                self._arm(BODY_TIMEOUT)
            else:
                self._disarm()
        elif not cycle.more_body and self._waiting_for == BODY_TIMEOUT:  # its body is complete
            self._disarm()

    def _arm(self, waiting_for: str) -> None:
        self._disarm()
        self._waiting_for = waiting_for
        self._deadline = self.loop.call_later(self.guard.read_timeout_s, self._expired)
        if waiting_for == HEADERS_TIMEOUT:
            self.guard.waiting[self] = None  # the newest waiter: last in line for eviction

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, None
        self.guard.waiting.pop(self, None)

    def _expired(self) -> None:
        waiting_for = self._waiting_for
        self._deadline, self._waiting_for = None, None
        self.guard.waiting.pop(self, None)
        if self.transport.is_closing() or waiting_for is None:
            return
        self.guard.closed(waiting_for)
        if waiting_for == BODY_TIMEOUT and not self.cycle.response_started:
            self.transport.write(_error_response(
                408, "Request Timeout", f"the request body did not arrive within {self.guard.read_timeout_s:g} s"))
        self.transport.close()
