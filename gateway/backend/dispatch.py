"""Runs one request on a backend: route, count its load, stream, retry once, abort on cancel.

The failure rules of the public API live here:

- before the backend's first message, an UNAVAILABLE backend is retried once on another backend
  (nothing has reached the client yet, so the retry is invisible to it). Nothing else is retried:
  an INTERNAL failure may be the request's own (a poison request), and replaying it elsewhere would
  only fail it there too; it reaches the client as INTERNAL;
- after the first message, a backend failure ends the stream UNAVAILABLE: the tokens already sent
  cannot be taken back, and replaying the request elsewhere would sample a different continuation;
- a client that cancels, or whose deadline passes, cancels the backend call (which aborts the
  request there) and also sends an explicit Abort, so the blocks are freed even if the backend
  notices the cancellation late.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from gateway.backend.compute_convert import delta_from_pb, to_compute_request
from gateway.backend.pool import Backend, BackendPool
from gateway.backend.routing import RouteDecision, Router, block_hashes
from gateway.core.ports import Route
from gateway.core.types import BackendRequest, Delta
from pagedserve.compute.v1 import compute_pb2
from pagedserve.errors import (
    DeadlineExceededError,
    InvalidArgument,
    PreconditionError,
    RequestFailedError,
    ResourceExhaustedError,
    UnavailableError,
)
from pagedserve.log import get_logger
from pagedserve.trace_context import TRACEPARENT

if TYPE_CHECKING:
    from pagedserve.tracing import Span, Tracer

log = get_logger("gateway.dispatch")

# Failures before the first token that another backend may not share: the backend is down. An
# INTERNAL one may be the request's own (a poison request) and would fail the same way elsewhere.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
# Backend codes that reach the client as they are (as the shared error types, which the server's
# interceptor maps back to the same codes); every other failure is UNAVAILABLE.
_PASSED_THROUGH: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.FAILED_PRECONDITION: PreconditionError,
    grpc.StatusCode.INTERNAL: RequestFailedError,
}


def _client_error(exc: grpc.aio.AioRpcError) -> Exception:
    """What the client gets for a backend's failure before its first message."""
    kind = _PASSED_THROUGH.get(exc.code())
    if kind is not None:
        return kind(exc.details())
    # The transport's own words ("Stream removed (recvmsg:Connection reset by peer (104))", backend
    # addresses) help no client and describe the backends to anyone: logged here, not sent.
    log.info("backend_call_failed", code=exc.code().name, details=exc.details())
    return UnavailableError("backend unavailable")


class Dispatcher:
    """Sends requests to the pool's backends (the core's ``Backends`` port).

    Args:
        pool: the backends.
        router: the routing policy.
        affinity_max_blocks: leading prompt blocks hashed for affinity.
        on_route: called with every routing decision (the routing metrics).
    """

    def __init__(self, pool: BackendPool, router: Router, affinity_max_blocks: int,
                 on_route: Callable[[RouteDecision], None] | None = None) -> None:
        self.pool = pool
        self.router = router
        self.affinity_max_blocks = affinity_max_blocks
        self._on_route = on_route
        self.tracer: Tracer | None = None  # set by the gateway when traces are on (pagedserve/tracing.py)

    def num_backends(self) -> int:
        return len(self.pool.backends)

    def num_in_rotation(self, model_name: str) -> int:
        return len(self.pool.in_rotation(model_name))

    async def run(self, request: BackendRequest, model_name: str, route: Route,
                  timeout_s: float | None, span: Span | None = None) -> AsyncIterator[Delta]:
        """Streams the backend's answer to ``request``, as deltas.

        Args:
            request: the validated, tokenized request (converted to the compute service's message
                here, with a request id of its own per attempt).
            model_name: only backends serving this model are used.
            route: filled with the backend used.
            timeout_s: the client's remaining time (None = no deadline).
            span: the request's span (traces on): each attempt is a ``gateway.backend_call`` child,
                whose traceparent the call carries.
        Raises:
            UnavailableError: no backend could serve it, or the backend failed mid-stream.
            DeadlineExceededError: the client's deadline passed mid-stream.
            InvalidArgument, ResourceExhaustedError, PreconditionError: the backend's own answer.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tried: set[str] = set()
        first_error: Exception | None = None
        for attempt in range(2):
            candidates = [b for b in self.pool.in_rotation(model_name) if b.address not in tried]
            if not candidates:
                break
            block_size = candidates[0].info.block_size if candidates[0].info else 16
            hashes = block_hashes(request.prompt_token_ids, block_size or 16,
                                  f"{model_name}|{request.cache_salt}", self.affinity_max_blocks)
            decision = self.router.decide(candidates, hashes)
            backend = decision.target
            assert isinstance(backend, Backend)
            # Counted now, before the first await: concurrent requests see this one's load.
            ticket = backend.acquire(len(request.prompt_token_ids) + request.n * request.max_tokens)
            if self._on_route is not None:
                self._on_route(decision)
            tried.add(backend.address)
            route.backend, route.num_attempts = backend.address, attempt + 1
            message = to_compute_request(request, f"gw-{uuid.uuid4().hex}")
            # A retry gets what is left of the client's time, not the whole of it again.
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            call_span = metadata = call_error = None
            if span is not None and self.tracer is not None:
                call_span = self.tracer.start("gateway.backend_call", span, kind="client", attributes={
                    "pagedserve.backend": backend.address, "pagedserve.attempt": attempt + 1,
                    "pagedserve.backend_request_id": message.request_id})
                metadata = ((TRACEPARENT, self.tracer.traceparent(call_span)),)
            call = backend.stub.Generate(message, timeout=remaining, metadata=metadata)
            route.canceller = functools.partial(_cancel, call, backend, message.request_id)
            has_first = False
            try:
                async for reply in call:
                    if not has_first:
                        ticket.consume(len(request.prompt_token_ids))  # the prompt is prefilled
                        has_first = True
                    ticket.consume(len(reply.token_ids))
                    yield delta_from_pb(reply)
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                call_error = code.name
                if code == grpc.StatusCode.UNAVAILABLE:
                    backend.mark_failed(f"request failed: {exc.details()}")
                if has_first:
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise DeadlineExceededError("deadline exceeded") from None
                    log.info("backend_call_failed", request_id=message.request_id, backend=backend.address,
                             code=code.name, details=exc.details())
                    raise UnavailableError("backend failed mid-stream") from None
                error = _client_error(exc)
                first_error = first_error or error
                if code not in _RETRYABLE:
                    raise error from None
                log.info("retrying", request_id=message.request_id, backend=backend.address, code=code.name)
            finally:
                ticket.release()
                route.cancel()  # a no-op unless the client went away (cancel, deadline) mid-call
                if call_span is not None and self.tracer is not None:
                    self.tracer.end(call_span, error=call_error)
        raise first_error or UnavailableError("no healthy backend")


def _cancel(call: grpc.aio.UnaryStreamCall, backend: Backend, request_id: str) -> None:
    """Cancels a backend call that is still running (which aborts the request there), and sends an
    explicit Abort too, so the blocks are freed even if the backend notices the cancellation late."""
    if not call.done():
        call.cancel()
        asyncio.ensure_future(_abort(backend, request_id))


async def _abort(backend: Backend, request_id: str) -> None:
    """Best effort: the cancelled call already aborts the request; this covers a late notice."""
    try:
        await backend.stub.Abort(compute_pb2.AbortRequest(request_id=request_id), timeout=5.0)
    except grpc.aio.AioRpcError:
        pass  # the backend is gone or the request already ended: nothing left to free
