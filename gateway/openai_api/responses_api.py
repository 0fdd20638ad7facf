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
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.core.service import RequestRecord
from gateway.core.streaming import ReplyBudget, collect, pieces
from gateway.openai_api import convert
from gateway.openai_api.edge import Front
from gateway.openai_api.errors import HttpError, access_status
from gateway.openai_api.handler import admitted, answered, event_stream, failure_body, rendered, request_id_of
from gateway.openai_api.response_store import ResponseStore, StoredResponse, stored_bytes
from gateway.openai_api.responses_convert import chat_body, renamed
from gateway.openai_api.responses_events import Draft, Output, events, new_id
from gateway.openai_api.responses_schema import ResponsesRequest
from gateway.openai_api.schema import ChatCompletionRequest
from gateway.openai_api.transport import first_piece, until_disconnect
from gateway.tenants import Admission, Tenant
from pagedserve.errors import echo
from pagedserve.log import get_logger

log = get_logger("gateway.openai")

METHOD = "OpenAI.Responses"


class ResponsesEndpoint:
    """The Responses API over one HTTP front (its tenants, body reading and model check).

    Args:
        front: the HTTP front it is part of.
        store: where ``store: true`` responses are kept, by tenant namespace.
    """

    def __init__(self, front: Front, store: ResponseStore) -> None:
        self.front = front
        self.core = front.core
        self.store = store

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]

    def _stored(self, tenant: Tenant, response_id: str, param: str | None = None) -> StoredResponse:
        """The tenant's stored response; a 404 (a 400 naming ``param``, when a request names it) otherwise."""
        stored = self.store.get(tenant.namespace, response_id)
        if stored is None:
            status = 400 if param else 404
            raise HttpError(status, f"Response with id {echo(response_id)} not found (stored responses are kept "
                                    f"{self.store.limits.ttl_s:g} s, on the gateway replica that answered)", param)
        return stored

    async def _logged(self, request: Request, method: str, work: Callable[[Tenant], Awaitable[Response]]) -> Response:
        """``work``'s answer for the key's tenant, with an access line (method, status, tenant)."""
        record = RequestRecord(method, request_id_of(request, "resp-op"))

        async def run(_: list[str]) -> Response:
            tenant = self.front.tenant_of(request)
            record.tenant = tenant.name
            return await work(tenant)

        response = await answered(run)
        record.status = access_status(response.status_code)
        self.core.finish(record, None)
        return response

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        return await self._logged(request, "OpenAI.Responses.Retrieve",
                                  lambda tenant: self._body_of(tenant, response_id))

    async def _body_of(self, tenant: Tenant, response_id: str) -> Response:
        return JSONResponse(self._stored(tenant, response_id).body)

    async def delete(self, request: Request) -> Response:
        async def work(tenant: Tenant) -> Response:
            response_id = request.path_params["response_id"]
            self._stored(tenant, response_id)
            self.store.delete(tenant.namespace, response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})

        return await self._logged(request, "OpenAI.Responses.Delete", work)

    async def create(self, request: Request) -> Response:
        return await answered(lambda constraint_param: self._create(request, constraint_param), renamed)

    async def _create(self, request: Request, constraint_param: list[str]) -> Response:
        tenant = self.front.tenant_of(request)
        body: ResponsesRequest = await self.front.read_body(request, ResponsesRequest)
        draft = Draft(new_id("resp"), self.front.served_model(body.model), body)
        context = self._stored(tenant, body.previous_response_id, "previous_response_id").context \
            if body.previous_response_id else []
        chat, conversation = chat_body(body, context)
        # The request's id (the access line's, the backend's) is the client's x-request-id when it
        # sends one; the response's id stays the gateway's own, unique, as stored responses need.
        request_id = request.headers.get("x-request-id") or draft.id
        return await admitted(self.core, tenant, RequestRecord(METHOD, request_id), chat.priority or 0, 1,
                              lambda admissions: self._run(request, request_id, draft, chat, conversation, tenant,
                                                           admissions, constraint_param))

    async def _keep(self, tenant: Tenant, final: dict, conversation: list[dict], out: Output) -> None:
        """Stores the response when asked; one too large to store says ``store: false`` (and is logged)."""
        if final["store"] is False:
            return
        context = [*conversation, out.chat_message()]
        num_bytes = await asyncio.to_thread(stored_bytes, final, context)
        if not self.store.put(tenant.namespace, final, context, num_bytes):
            final["store"] = False
            log.warning("responses_store_refused", response_id=final["id"], tenant=tenant.name, num_bytes=num_bytes,
                        max_bytes=min(self.store.limits.max_bytes, self.store.limits.max_total_bytes))

    async def _run(self, request: Request, request_id: str, draft: Draft, chat: ChatCompletionRequest,
                   conversation: list[dict], tenant: Tenant, admissions: list[Admission],
                   constraint_param: list[str]) -> Response:
        """The admitted request: run through the core, answered whole or streamed, stored when asked."""
        body = draft.body
        prompt = convert.chat_prompt(chat, request_id)
        constraint_param.extend([prompt.constraint_param] if prompt.constraint_param else [])
        record = RequestRecord(METHOD, request_id)
        reply = None if body.stream else ReplyBudget(self.core.config.max_message_bytes, hint="use stream: true")
        deltas = self.core.run(prompt.request, record, tenant, None, admission=admissions[0], reply=reply,
                               max_tokens_to_context=True)

        async def keep(final: dict, out: Output) -> None:
            await self._keep(tenant, final, conversation, out)

        if not body.stream:
            answer = await until_disconnect(request.receive, collect(request_id, deltas))
            [choice] = answer.choices
            out = Output(choice.text, choice.tool_calls, choice.finish_reason, answer.usage)
            final = draft.json(out.status, out)
            await keep(final, out)
            return await rendered(lambda: final)
        streamed = pieces(deltas)
        first = await first_piece(request.receive, streamed)
        return event_stream(self.core, events(draft, first, streamed,
                                              lambda exc: failure_body(exc, constraint_param, renamed), keep),
                            [record], admissions)
