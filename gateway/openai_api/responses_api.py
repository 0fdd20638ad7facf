"""OpenAI's Responses API on the HTTP front: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``.

The same path as a chat completion, not a second one: the body becomes the chat body it means
(``responses_convert``), ``convert.chat_prompt`` makes the core's request of it, and
``GatewayCore.run`` answers it (admission, the tenant's limits and priority cap, validation, the
reply cap of a whole answer, the write-stall rule of a stream, metrics and the access line, method
``OpenAI.Responses``). Only the answer's shape is the Responses API's own (``responses_events``),
and ``store``/``previous_response_id`` (``response_store``: per tenant, bounded, expiring, in this
gateway's memory).

Not over gRPC: the public gRPC API has chat messages and tools already, and what the Responses
API adds is HTTP-side state (stored responses) and event shapes that a gRPC client would not parse.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.core.service import RequestRecord
from gateway.core.streaming import ReplyBudget, collect, pieces
from gateway.openai_api import convert
from gateway.openai_api.edge import Front
from gateway.openai_api.errors import HttpError, as_http_error, error_body
from gateway.openai_api.response_store import ResponseStore, StoredResponse
from gateway.openai_api.responses_convert import chat_body, renamed
from gateway.openai_api.responses_events import Draft, Output, events, new_id
from gateway.openai_api.responses_schema import ResponsesRequest
from gateway.openai_api.schema import ChatCompletionRequest
from gateway.openai_api.transport import ClientGone, EventStream, first_piece, until_disconnect
from gateway.tenants import Admission, Tenant
from pagedserve.errors import echo


METHOD = "OpenAI.Responses"


class ResponsesEndpoint:
    """The Responses API over one HTTP front (its tenants, body reading and model check).

    Args:
        front: the HTTP front it is part of.
        store: where ``store: true`` responses are kept.
    """

    def __init__(self, front: Front, store: ResponseStore) -> None:
        self.front = front
        self.core = front.core
        self.store = store

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]

    def _error_body(self, exc: BaseException, constraint_param: list[str]) -> tuple[int, dict]:
        """The status and OpenAI error object of a failure, naming the Responses parameter."""
        error = renamed(as_http_error(exc, constraint_param[0] if constraint_param else None))
        return error.status, error_body(error.status, error.message, error.param)

    def _error(self, exc: BaseException, constraint_param: list[str] | None = None) -> JSONResponse:
        status, body = self._error_body(exc, constraint_param or [])
        return JSONResponse(body, status_code=status)

    def _stored(self, tenant: Tenant, response_id: str, param: str | None = None) -> StoredResponse:
        """The tenant's stored response; a 404 (a 400 naming ``param``, when a request names it) otherwise."""
        stored = self.store.get(tenant.name, response_id)
        if stored is None:
            status = 400 if param else 404
            raise HttpError(status, f"Response with id {echo(response_id)} not found (stored responses are kept "
                                    f"{self.store.limits.ttl_s:g} s, on the gateway replica that answered)", param)
        return stored

    async def retrieve(self, request: Request) -> Response:
        try:
            tenant = self.front.tenant_of(request)
            return JSONResponse(self._stored(tenant, request.path_params["response_id"]).body)
        except Exception as exc:  # every failure becomes an OpenAI error object
            return self._error(exc)

    async def delete(self, request: Request) -> Response:
        try:
            tenant = self.front.tenant_of(request)
            response_id = request.path_params["response_id"]
            self._stored(tenant, response_id)
            self.store.delete(tenant.name, response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        except Exception as exc:  # every failure becomes an OpenAI error object
            return self._error(exc)

    async def create(self, request: Request) -> Response:
        constraint_param: list[str] = []  # the parameter that gave the constraint, once converted
        try:
            return await self._create(request, constraint_param)
        except (ClientGone, ClientDisconnect):  # nobody reads it; the access line says CANCELLED
            return Response(status_code=499)
        except Exception as exc:  # every failure becomes an OpenAI error object
            return self._error(exc, constraint_param)

    async def _create(self, request: Request, constraint_param: list[str]) -> Response:
        tenant = self.front.tenant_of(request)
        body: ResponsesRequest = await self.front.read_body(request, ResponsesRequest)
        draft = Draft(new_id("resp"), self.front.served_model(body.model), body)
        context = self._stored(tenant, body.previous_response_id, "previous_response_id").context \
            if body.previous_response_id else []
        chat, conversation = chat_body(body, context)
        [admission] = self.core.admit(tenant, RequestRecord(METHOD, draft.id), chat.priority or 0)
        try:
            return await self._run(request, draft, chat, conversation, tenant, admission, constraint_param)
        except BaseException:
            self.core.release([admission])  # idempotent: also when the request never started
            raise

    async def _run(self, request: Request, draft: Draft, chat: ChatCompletionRequest, conversation: list[dict],
                   tenant: Tenant, admission: Admission, constraint_param: list[str]) -> Response:
        """The admitted request: run through the core, answered whole or streamed, stored when asked."""
        body = draft.body
        prompt = convert.chat_prompt(chat, draft.id)
        constraint_param.extend([prompt.constraint_param] if prompt.constraint_param else [])
        record = RequestRecord(METHOD, draft.id)
        reply = None if body.stream else ReplyBudget(self.core.config.max_message_bytes, hint="use stream: true")
        deltas = self.core.run(prompt.request, record, tenant, None, admission=admission, reply=reply,
                               max_tokens_to_context=True)

        def keep(final: dict, out: Output) -> None:
            if body.store is not False:
                self.store.put(tenant.name, final, [*conversation, out.chat_message()])

        if not body.stream:
            answer = await until_disconnect(request.receive, collect(draft.id, deltas))
            [choice] = answer.choices
            out = Output(choice.text, choice.tool_calls, choice.finish_reason, answer.usage)
            final = draft.json(out.status, out)
            keep(final, out)
            return await asyncio.to_thread(lambda: JSONResponse(final))
        streamed = pieces(deltas)
        first = await first_piece(request.receive, streamed)

        def failed(exc: BaseException) -> dict:
            return self._error_body(exc, constraint_param)[1]

        return EventStream(events(draft, first, streamed, failed, keep), self.core.config.write_stall_timeout_s,
                           on_stall=lambda: self.core.stalled([record]),
                           on_close=lambda: self.core.release([admission]))
