"""The client's W3C ``traceparent`` at the gateway's fronts (docs/design.md, "Traces").

Each front puts the header it got (gRPC metadata, HTTP header) in ``INCOMING_TRACEPARENT`` for the
task serving the call, and ``GatewayCore.run`` opens the request's span under it: one place that
reads it, whatever the front, endpoint or prompt list (each prompt of a list is a request, all of
them children of the one header). A context variable, not a parameter threaded through every
endpoint: the HTTP endpoints reach ``run`` by many paths, and the value is per task by nature.
Used only when traces are on; with them off nothing here runs.
"""

from __future__ import annotations

from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.trace_context import TRACEPARENT

INCOMING_TRACEPARENT: ContextVar[str | None] = ContextVar("incoming_traceparent", default=None)

_HEADER = TRACEPARENT.encode()


class TraceparentMiddleware:
    """ASGI: each HTTP request's ``traceparent`` header in ``INCOMING_TRACEPARENT`` for its task
    (uvicorn runs each request in a task of its own, so the value never leaks to another)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            value = next((v for k, v in scope["headers"] if k == _HEADER), None)
            INCOMING_TRACEPARENT.set(None if value is None else value.decode("latin-1"))
        await self.app(scope, receive, send)
