"""The OpenAI-compatible HTTP front of the gateway: a Starlette app, a thin edge over the gateway core.

A second edge over the same core, not a second gateway: each endpoint turns its JSON body into the
core's ``GenerateRequest`` (``convert``), runs it through ``GatewayCore.run`` (the admission,
validation, tokenizing, routing, metrics and access line every gRPC call gets) and turns the
core's answer into OpenAI's JSON (``responses``). Keys name the gRPC front's tenants (the same
``Tenants.identify``), so each tenant's limits, priority cap and cache namespace hold here too.

Errors are OpenAI error objects with the gRPC code's HTTP status (``errors``). A body is read up
to the gateway's ``max_message_bytes`` (a larger one is 413 before it is read) and parsed by
pydantic, so malformed JSON and wrong types are 400s naming the field. A client that disconnects,
or stops reading a stream, aborts its requests (``transport``).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import bearer_token
from gateway.core.service import GatewayCore, RequestRecord
from gateway.core.streaming import ReplyBudget, pieces
from gateway.core.types import Delta
from gateway.openai_api import convert
from gateway.openai_api.embeddings_api import create_embeddings
from gateway.openai_api.errors import HttpError, ParamError, as_http_error, error_body, error_response
from gateway.openai_api.handler import admitted, answered, event_stream, failure_body, rendered, request_id_of
from gateway.openai_api.response_store import ResponseStore, StoreLimits
from gateway.openai_api.responses import Answer, events, merge
from gateway.openai_api.responses_api import ResponsesEndpoint
from gateway.openai_api.schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       error_param, unknown_fields)
from gateway.openai_api.transport import first_piece, until_disconnect, whole_answers
from gateway.tenants import Admission, Tenant
from pagedserve.errors import ResourceExhaustedError, echo
from pagedserve.log import get_logger

__all__ = ["OpenAIFront", "as_http_error", "error_body"]

log = get_logger("gateway.openai")


def pagedserve_version() -> str:
    try:
        return package_version("pagedserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


class OpenAIFront:
    """The HTTP endpoints over one gateway's core.

    Args:
        core: the gateway core every request goes through.
        is_serving: whether the gateway is ready (its health check says SERVING).
    """

    def __init__(self, core: GatewayCore, is_serving: Callable[[], bool]) -> None:
        self.core = core
        self.is_serving = is_serving
        self.responses = ResponsesEndpoint(self, ResponseStore(StoreLimits(
            core.config.responses_store_max_responses, core.config.responses_store_max_bytes,
            core.config.responses_store_ttl_s, core.config.responses_store_max_total_bytes)))
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            *self.responses.routes(),
            Route("/v1/embeddings", functools.partial(create_embeddings, self), methods=["POST"]),
        ], exception_handlers={HTTPException: self._http_exception})

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """Starlette's refusals before any endpoint: an unknown route (404) or method (405).

        Said as OpenAI says it (``Invalid URL (POST /v1/x)``, no ``code``): the 404 of an unknown
        model is ``model_not_found``, and a client told that for a route it called (langchain raises
        ``OpenAIModelNotFoundError``) looks for the wrong mistake. Counted and logged as an access
        line (method ``OpenAI.UnknownRoute``) like any refused request.
        """
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        message = str(exc.detail)
        if status in (404, 405):
            what = "no such route" if status == 404 else "method not allowed on this route"
            path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."
            message = f"Invalid URL ({request.method[:16]} {path}): {what}"
            record = RequestRecord("OpenAI.UnknownRoute", uuid.uuid4().hex)
            record.status = "NOT_FOUND" if status == 404 else "UNIMPLEMENTED"
            self.core.finish(record, None, path=f"{request.method[:16]} {path}")
        return JSONResponse(error_body(status, message), status_code=status)

    def tenant_of(self, request: Request) -> Tenant:
        """Who the key says the client is: the gRPC front's tenants, the same lookup."""
        header = request.headers.get("authorization", "")
        tenant = self.core.tenants.identify(bearer_token([("authorization", header)]))
        if tenant is None:
            raise HttpError(401, "missing or invalid API key (Authorization: Bearer KEY)")
        self.core.tenants.charge(tenant)  # its max_requests_per_s, before the body is read
        return tenant

    def served_model(self, name: str | None) -> str:
        model = self.core.model
        if model is None:
            raise HttpError(503, "no backend has been reached yet")
        if name is not None and name != model.info.model_name:
            raise HttpError(404, f"The model {echo(name)} does not exist (this gateway serves "
                                 f"{model.info.model_name!r})", "model")
        return model.info.model_name

    async def read_body(self, request: Request, schema: type[BaseModel]) -> Any:
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
            param = error_param(first["loc"], schema)
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
            self.tenant_of(request)
            if self.core.model is None or not self.is_serving():
                raise HttpError(503, "no backend is ready yet")
        except (HttpError, ResourceExhaustedError) as exc:  # a 429: the tenant's max_requests_per_s
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pagedserve_version()})

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``/tokenizer_info``: the special tokens and chat template, so that a client can
        tokenize with this server's ``/tokenize`` and ``/detokenize`` instead of a local copy of the
        tokenizer (lm-evaluation-harness's remote tokenizer looks for it)."""
        try:
            self.tenant_of(request)
            model = self.core.model
            if model is None or not self.is_serving():
                raise HttpError(503, "no backend is ready yet")
        except (HttpError, ResourceExhaustedError) as exc:  # a 429: the tenant's max_requests_per_s
            return error_response(exc)
        return JSONResponse(model.tokenizer_info())

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens": [ids], "token_strs"}`` (the gRPC
        ``Tokenize`` names them the other way round: ``token_ids`` and ``tokens``)."""
        async def work(_: list[str]) -> Response:
            tenant = self.tenant_of(request)
            body = await self.read_body(request, TokenizeRequest)
            self.served_model(body.model)
            converted = convert.tokenize_request(body)
            record = RequestRecord("OpenAI.Tokenize", uuid.uuid4().hex)
            token_ids = await until_disconnect(
                request.receive, self.core.tokenize(converted, record, tenant, body.add_special_tokens,
                                                        body.add_generation_prompt))
            model = self.core.require_model()
            return JSONResponse({"count": len(token_ids), "max_model_len": model.info.max_model_len,
                                 "tokens": token_ids, "token_strs": model.tokens(token_ids)})

        return await answered(work)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"model", "tokens": [ids]}`` -> ``{"prompt"}``."""
        async def work(_: list[str]) -> Response:
            tenant = self.tenant_of(request)
            body = await self.read_body(request, DetokenizeRequest)
            self.served_model(body.model)
            record = RequestRecord("OpenAI.Detokenize", uuid.uuid4().hex)
            text = await until_disconnect(request.receive, self.core.detokenize(body.tokens, record, tenant))
            return JSONResponse({"prompt": text})

        return await answered(work)

    async def model(self, request: Request) -> Response:
        try:
            self.tenant_of(request)
            self.served_model(request.path_params["model"])
        except (HttpError, ResourceExhaustedError) as exc:  # a 429: the tenant's max_requests_per_s
            return error_response(exc)
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, endpoint: str) -> Response:
        return await answered(lambda constraint_param: self._answer(request, endpoint, constraint_param))

    async def _answer(self, request: Request, endpoint: str, constraint_param: list[str]) -> Response:
        tenant = self.tenant_of(request)
        schema = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        body = await self.read_body(request, schema)
        model_name = self.served_model(body.model)
        request_id = request_id_of(request, "chatcmpl" if endpoint == "chat" else "cmpl")
        method = "OpenAI.ChatCompletions" if endpoint == "chat" else "OpenAI.Completions"
        num_prompts = 1 if endpoint == "chat" else convert.num_prompts(body)
        limit = self.core.config.max_prompts_per_request
        if num_prompts > limit:
            raise ParamError("prompt", f"prompt: at most {limit} prompts per request "
                                       f"(max_prompts_per_request), got {num_prompts}")
        return await admitted(self.core, tenant, RequestRecord(method, request_id), body.priority or 0,
                              max(num_prompts, 1),
                              lambda admissions: self._run(request, body, endpoint, method, request_id, model_name,
                                                           tenant, admissions, constraint_param))

    async def _run(self, request: Request, body: Any, endpoint: str, method: str, request_id: str, model_name: str,
                   tenant: Tenant, admissions: list[Admission], constraint_param: list[str]) -> Response:
        """The admitted request: converted, run through the core, answered (whole or streamed)."""
        prompts = [convert.chat_prompt(body, request_id)] if endpoint == "chat" else \
            convert.completion_prompts(body, request_id)
        constraint_param.extend(p.constraint_param for p in prompts[:1] if p.constraint_param)
        model = self.core.require_model()
        echo = None
        if endpoint == "completions" and body.echo:
            echo = [p.request.prompt if p.request.prompt is not None else p.request.prompt_token_ids for p in prompts]
        answer = Answer(request_id, model_name, endpoint, n=body.n or 1, logprobs=body.logprobs is not None
                        and body.logprobs is not False, decode=model.token_text,
                        include_usage=bool(body.stream_options and body.stream_options.include_usage),
                        echo=echo, decode_text=model.decode, num_top=prompts[0].request.options.logprobs or 0,
                        prompt_logprobs=body.prompt_logprobs is not None)
        # One unary answer carries what one gRPC reply may (the same cap, the same measure).
        # A completion repeats the prompt's scores in each choice: in its logprobs with echo, and in
        # prompt_logprobs when asked for (both: twice); a chat carries prompt_logprobs once (responses.py).
        copies = 1 if endpoint == "chat" else (body.n or 1) * max(
            1, (echo is not None and answer.logprobs) + answer.prompt_logprobs)
        reply = None if body.stream else ReplyBudget(self.core.config.max_message_bytes, hint="use stream: true",
                                                     prompt_copies=copies)
        records: list[RequestRecord] = []

        def run(prompt: convert.Prompt, admission: Admission) -> AsyncIterator[Delta]:
            records.append(RequestRecord(method, prompt.request.request_id))
            return self.core.run(prompt.request, records[-1], tenant, None, admission=admission, reply=reply,
                                 num_prompts=len(prompts), max_tokens_to_context=endpoint == "chat")

        if not body.stream:
            replies = await whole_answers(request.receive, [(p.request.request_id, run(p, a))
                                                            for p, a in zip(prompts, admissions)])
            return await rendered(lambda: answer.body(replies))  # its logprobs' texts take a while
        merged = merge([pieces(run(p, a)) for p, a in zip(prompts, admissions)])
        first = await first_piece(request.receive, merged)
        return event_stream(self.core, events(answer, first, merged, lambda exc: failure_body(exc, constraint_param)),
                            records, admissions)
