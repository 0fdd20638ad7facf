"""The skeleton every endpoint of the HTTP front that runs requests shares, written once.

- ``answered``: the endpoint's answer, a 499 when the client went away first, and any failure as an
  OpenAI error object naming the client's parameter (``failure``).
- ``admitted``: the tenant's slots for a request's prompts, all or none, released when the work
  fails before the requests own them (``core.run`` releases each once it runs; a stream's close
  releases them all).
- ``rendered``: a whole answer's JSON, built and encoded off the event loop (a large answer takes
  tens of milliseconds, which every other stream would wait for).
- ``event_stream``: a stream whose stall marks its requests and whose close releases the slots.
- ``request_id_of``: the client's ``x-request-id``, else a new id, as every endpoint names its request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from gateway.core.service import GatewayCore, RequestRecord
from gateway.openai_api.errors import HttpError, as_http_error, error_body
from gateway.openai_api.transport import ClientGone, EventStream
from gateway.tenants import Admission, Tenant

Rename = Callable[[HttpError], HttpError]  # the error naming the endpoint's own parameter


def _same(error: HttpError) -> HttpError:
    return error


def request_id_of(request: Request, prefix: str) -> str:
    return request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"


def failure(exc: BaseException, constraint_param: list[str], rename: Rename = _same) -> HttpError:
    """A failure's HTTP answer (``as_http_error``), naming the endpoint's parameter."""
    return rename(as_http_error(exc, constraint_param[0] if constraint_param else None))


def failure_body(exc: BaseException, constraint_param: list[str], rename: Rename = _same) -> dict:
    """``failure``'s OpenAI error object (a stream's error event carries it)."""
    error = failure(exc, constraint_param, rename)
    return error_body(error.status, error.message, error.param)


async def answered(work: Callable[[list[str]], Awaitable[Response]], rename: Rename = _same) -> Response:
    """``work``'s response, or the status of its failure.

    Args:
        work: the endpoint's body, given a list to put the parameter that gave the request's
            constraint in, once converted (the compute service's verdict on it names that).
    """
    constraint_param: list[str] = []
    try:
        return await work(constraint_param)
    except (ClientGone, ClientDisconnect):  # gone mid-body too (or cut off by the body read deadline)
        return Response(status_code=499)  # nobody reads it; the access line says CANCELLED
    except Exception as exc:  # every failure becomes an OpenAI error object
        error = failure(exc, constraint_param, rename)
        return JSONResponse(error_body(error.status, error.message, error.param), status_code=error.status)


async def admitted(core: GatewayCore, tenant: Tenant, record: RequestRecord, priority: int, count: int,
                   work: Callable[[list[Admission]], Awaitable[Response]]) -> Response:
    """``work``'s response, run with ``count`` slots of the tenant taken before any prompt is
    converted (a list beyond the free slots costs a comparison, not a request object per prompt).

    Raises:
        PermissionDeniedError, ResourceExhaustedError: as ``core.admit``; or what ``work`` raises,
        its slots released first.
    """
    admissions = core.admit(tenant, record, priority, count)
    try:
        return await work(admissions)
    except BaseException:
        core.release(admissions)  # idempotent: also those of requests that never started
        raise


async def rendered(body: Callable[[], Any]) -> JSONResponse:
    """The JSON answer of ``body()``, built and encoded on a worker thread."""
    return await asyncio.to_thread(lambda: JSONResponse(body()))


def event_stream(core: GatewayCore, content: AsyncIterator[str], records: list[RequestRecord],
                 admissions: list[Admission]) -> EventStream:
    """An SSE response of ``content`` under the gateway's write-stall rule."""
    return EventStream(content, core.config.write_stall_timeout_s, on_stall=lambda: core.stalled(records),
                       on_close=lambda: core.release(admissions))
