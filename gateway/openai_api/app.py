"""The OpenAI-compatible HTTP front of the gateway: a Starlette app, a thin edge over the gateway core.

A second edge over the same core, not a second gateway: each endpoint turns its JSON body into the
core's ``GenerateRequest`` (``convert``), runs it through ``GatewayCore.run`` (the admission,
validation, tokenizing, routing, metrics and access line every gRPC call gets) and turns the
core's answer into OpenAI's JSON (``responses``). Keys name the gRPC front's tenants (the same
``Tenants.identify``), so each tenant's limits, priority cap and cache namespace hold here too.

Errors are OpenAI error objects, ``{"error": {"message", "type", "param", "code"}}``, with the
HTTP status of the gRPC code the same request gets on the gRPC front (``STATUS``). A body is read
up to the gateway's ``max_message_bytes`` (a larger one is 413 before it is read) and parsed by
pydantic, so malformed JSON and wrong types are 400s naming the field.

A client that disconnects aborts its request: the handler races the work against the ASGI
``http.disconnect`` message (awaiting it directly, since ``request.is_disconnected()`` does not see
it behind middleware, as vLLM found), and cancelling the work closes the backend call, which frees
the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, TypeVar

import anyio
import grpc
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.auth import bearer_token
from gateway.core.service import GatewayCore, RequestRecord
from gateway.core.streaming import ReplyBudget, collect, pieces, send_within
from gateway.core.types import Delta
from gateway.openai_api import convert
from gateway.openai_api.errors import ParamError
from gateway.openai_api.responses import Answer, events, merge
from gateway.openai_api.schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       error_param, unknown_fields)
from gateway.tenants import Admission, Tenant
from pagedserve import rpc
from pagedserve import sampling_rules as rules
from pagedserve.errors import echo
from pagedserve.log import get_logger

log = get_logger("gateway.openai")
T = TypeVar("T")

# The HTTP status of each gRPC code, as the same request gets it on the gRPC front.
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error"}
_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}
# "params.top_p must be ...", "messages[2].role must be ...": the OpenAI parameter a message names.
_PARAM = re.compile(r"^(?:params\.)?([a-z_]+)")


def pagedserve_version() -> str:
    try:
        return package_version("pagedserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


class HttpError(Exception):
    """An answer other than 200, with its OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": _CODES.get(status)}}


def as_http_error(exc: BaseException, constraint_param: str | None = None) -> HttpError:
    """The HTTP answer of a failed request: the status its gRPC code has, the message naming the field.

    ``constraint_param``: the OpenAI parameter that gave the request's constraint (``response_format``,
    ``structured_outputs.json``, ...); the compute service's verdict on the constraint names the
    gRPC field (``params.json_schema``), so the answer names this parameter instead.
    """
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, ParamError):
        return HttpError(400, str(exc), exc.param)
    code = rpc.status_for(exc)
    message = str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        match = _PARAM.match(message)
        param = match.group(1) if match else None
        if constraint_param and param in rules.CONSTRAINT_KINDS:
            return HttpError(400, f"{constraint_param}: {message.removeprefix('params.')}", constraint_param)
        return HttpError(400, message.removeprefix("params."), param)
    if code not in STATUS:  # a bug: logged with its traceback, answered 500
        log.error("openai_internal_error", error=repr(exc), exc_info=exc)
        return HttpError(500, "internal error")
    return HttpError(STATUS[code], message)


def _error(exc: BaseException, constraint_param: str | None = None) -> JSONResponse:
    error = as_http_error(exc, constraint_param)
    return JSONResponse(error_body(error.status, error.message, error.param), status_code=error.status)


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


class OpenAIFront:
    """The HTTP endpoints over one gateway's core.

    Args:
        core: the gateway core every request goes through.
        is_serving: whether the gateway is ready (its health check says SERVING).
    """

    def __init__(self, core: GatewayCore, is_serving: Callable[[], bool]) -> None:
        self.core = core
        self.is_serving = is_serving
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_exception})

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(exc.status_code, exc.detail), status_code=exc.status_code)

    def _tenant(self, request: Request) -> Tenant:
        """Who the key says the client is: the gRPC front's tenants, the same lookup."""
        header = request.headers.get("authorization", "")
        tenant = self.core.tenants.identify(bearer_token([("authorization", header)]))
        if tenant is None:
            raise HttpError(401, "missing or invalid API key (Authorization: Bearer KEY)")
        return tenant

    def _served(self, name: str | None) -> str:
        model = self.core.model
        if model is None:
            raise HttpError(503, "no backend has been reached yet")
        if name is not None and name != model.info.model_name:
            raise HttpError(404, f"The model {echo(name)} does not exist (this gateway serves "
                                 f"{model.info.model_name!r})", "model")
        return model.info.model_name

    async def _read(self, request: Request, schema: type[BaseModel]) -> Any:
        limit = self.core.config.max_message_bytes
        content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if content_type != "application/json" and not content_type.endswith("+json"):
            raise HttpError(415, f"Content-Type must be application/json, got {echo(content_type)}")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise HttpError(413, f"request body of {length} bytes is larger than {limit} bytes")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise HttpError(413, f"request body is larger than {limit} bytes")
        try:
            body = schema.model_validate_json(bytes(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            if first["type"] == "json_invalid":
                raise HttpError(400, f"the body is not valid JSON: {first['msg']}") from None
            param = error_param(first["loc"])
            raise HttpError(400, f"{param or 'body'}: {first['msg']}", param) from None
        if body.model_extra:
            log.info("openai_unknown_fields", path=request.url.path, **unknown_fields(body))
        return body

    async def health(self, request: Request) -> Response:
        if not self.is_serving():
            return JSONResponse(error_body(503, "not serving"), status_code=503)
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict:
        model = self.core.model
        assert model is not None
        return {"id": model.info.model_name, "object": "model", "created": 0, "owned_by": "pagedserve",
                "max_model_len": model.info.max_model_len}

    async def models(self, request: Request) -> Response:
        """The served model, once a backend is ready: 503 before (a client polling it for readiness
        must not send while the model loads, nor when no backend is in rotation)."""
        try:
            self._tenant(request)
            if self.core.model is None or not self.is_serving():
                raise HttpError(503, "no backend is ready yet")
        except HttpError as exc:
            return _error(exc)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pagedserve_version()})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens": [ids], "token_strs"}`` (the gRPC
        ``Tokenize`` names them the other way round: ``token_ids`` and ``tokens``)."""
        try:
            tenant = self._tenant(request)
            body = await self._read(request, TokenizeRequest)
            self._served(body.model)
            converted = convert.tokenize_request(body)
            record = RequestRecord("OpenAI.Tokenize", uuid.uuid4().hex)
            token_ids = await until_disconnect(
                request.receive, self.core.tokenize(converted, record, tenant, body.add_special_tokens))
            model = self.core.require_model()
            return JSONResponse({"count": len(token_ids), "max_model_len": model.info.max_model_len,
                                 "tokens": token_ids, "token_strs": model.tokens(token_ids)})
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
        except Exception as exc:  # every failure becomes an OpenAI error object
            return _error(exc)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"model", "tokens": [ids]}`` -> ``{"prompt"}``."""
        try:
            tenant = self._tenant(request)
            body = await self._read(request, DetokenizeRequest)
            self._served(body.model)
            record = RequestRecord("OpenAI.Detokenize", uuid.uuid4().hex)
            text = await until_disconnect(request.receive, self.core.detokenize(body.tokens, record, tenant))
            return JSONResponse({"prompt": text})
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
        except Exception as exc:  # every failure becomes an OpenAI error object
            return _error(exc)

    async def model(self, request: Request) -> Response:
        try:
            self._tenant(request)
            self._served(request.path_params["model"])
        except HttpError as exc:
            return _error(exc)
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, endpoint: str) -> Response:
        constraint_param: list[str] = []  # the parameter that gave the constraint, once converted
        try:
            return await self._answer(request, endpoint, constraint_param)
        except (ClientGone, ClientDisconnect):  # gone mid-body too (or cut off by the body read deadline)
            return Response(status_code=499)  # nobody reads it; the access line says CANCELLED
        except Exception as exc:  # every failure becomes an OpenAI error object
            return _error(exc, constraint_param[0] if constraint_param else None)

    async def _answer(self, request: Request, endpoint: str, constraint_param: list[str]) -> Response:
        tenant = self._tenant(request)
        schema = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        body = await self._read(request, schema)
        model_name = self._served(body.model)
        request_id = request.headers.get("x-request-id") or f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-" \
                                                            f"{uuid.uuid4().hex}"
        method = "OpenAI.ChatCompletions" if endpoint == "chat" else "OpenAI.Completions"
        num_prompts = 1 if endpoint == "chat" else convert.num_prompts(body)
        limit = self.core.config.max_prompts_per_request
        if num_prompts > limit:
            raise ParamError("prompt", f"prompt: at most {limit} prompts per request "
                                       f"(max_prompts_per_request), got {num_prompts}")
        # The tenant's slots for every prompt, all or none, before any prompt is converted: a list
        # beyond its free slots costs a comparison, not a request object and a task per prompt.
        admissions = self.core.admit(tenant, RequestRecord(method, request_id), body.priority or 0,
                                     max(num_prompts, 1))
        try:
            return await self._run(request, body, endpoint, method, request_id, model_name, tenant, admissions,
                                   constraint_param)
        except BaseException:
            self.core.release(admissions)  # idempotent: also those of requests that never started
            raise

    async def _run(self, request: Request, body: Any, endpoint: str, method: str, request_id: str, model_name: str,
                   tenant: Tenant, admissions: list[Admission], constraint_param: list[str]) -> Response:
        """The admitted request: converted, run through the core, answered (whole or streamed)."""
        prompts = [convert.chat_prompt(body, request_id)] if endpoint == "chat" else \
            convert.completion_prompts(body, request_id)
        constraint_param.extend(p.constraint_param for p in prompts[:1] if p.constraint_param)
        model = self.core.require_model()
        answer = Answer(request_id, model_name, endpoint, n=body.n or 1, logprobs=body.logprobs is not None
                        and body.logprobs is not False, decode=model.token_text,
                        include_usage=bool(body.stream_options and body.stream_options.include_usage))
        # One unary answer carries what one gRPC reply may (the same cap, the same measure).
        reply = None if body.stream else ReplyBudget(self.core.config.max_message_bytes, hint="use stream: true")
        records: list[RequestRecord] = []

        def run(prompt: convert.Prompt, admission: Admission) -> AsyncIterator[Delta]:
            records.append(RequestRecord(method, prompt.request.request_id))
            return self.core.run(prompt.request, records[-1], tenant, None, admission=admission, reply=reply,
                                 num_prompts=len(prompts), max_tokens_to_context=endpoint == "chat")

        if not body.stream:
            async def whole() -> list:
                async with asyncio.TaskGroup() as group:  # one prompt failing cancels the others
                    tasks = [group.create_task(collect(p.request.request_id, run(p, a)))
                             for p, a in zip(prompts, admissions)]
                return [t.result() for t in tasks]

            try:
                replies = await until_disconnect(request.receive, whole())
            except ExceptionGroup as group:
                raise group.exceptions[0] from None
            # Rendered off the event loop: a large answer's JSON (its logprobs' texts) takes a while.
            return await asyncio.to_thread(lambda: JSONResponse(answer.body(replies)))
        merged = merge([pieces(run(p, a)) for p, a in zip(prompts, admissions)])
        try:
            first = await until_disconnect(request.receive, anext(merged))
        except BaseException:
            await merged.aclose()
            raise

        def stream_error(exc: BaseException) -> dict:
            error = as_http_error(exc, constraint_param[0] if constraint_param else None)
            return error_body(error.status, error.message, error.param)

        return EventStream(events(answer, first, merged, stream_error), self.core.config.write_stall_timeout_s,
                           on_stall=lambda: self.core.stalled(records),
                           on_close=lambda: self.core.release(admissions))
