"""``pagedserve.gateway.v1.Gateway``: the public gRPC API, a thin edge over the gateway core.

Each call converts its message (``gateway.grpc.convert``), runs it through ``GatewayCore`` (the
admission, validation, tokenizing, routing, metrics and access line every front gets) and converts
the answer back. What is this front's own: the tenant from the call's metadata, the client's
deadline and cancellation, the unary reply's size cap (gRPC's send limit), and the write-stall
timeout of ``context.write``. Errors are ``pagedserve.errors`` types, answered by the server's
interceptor with their code.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc

from gateway.auth import bearer_token
from gateway.core.service import GatewayCore, RequestRecord
from gateway.core.streaming import ReplyBudget, collect, pieces, send_within
from gateway.core.types import Delta
from gateway.grpc.convert import piece_to_pb, reply_to_pb, request_from_pb, tokenize_from_pb
from gateway.tenants import Tenant
from gateway.traces import INCOMING_TRACEPARENT
from pagedserve.errors import DeadlineExceededError, InvalidArgument, ResourceExhaustedError
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.trace_context import traceparent_of


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The public service.

    Args:
        core: the gateway core every request goes through.
    """

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def _tenant(self, context: grpc.aio.ServicerContext, record: RequestRecord) -> Tenant:
        tenant = self.core.tenants.identify(bearer_token(context.invocation_metadata()))
        if tenant is None:  # the interceptor refuses these first; here for a server built without it
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key (authorization: Bearer KEY)")
        record.tenant = tenant.name
        try:
            self.core.tenants.charge(tenant)  # its max_requests_per_s, before the request is converted
        except ResourceExhaustedError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return tenant

    def _refused(self, record: RequestRecord, exc: InvalidArgument) -> InvalidArgument:
        """A message that does not convert: answered like a request the core refused."""
        record.status = grpc.StatusCode.INVALID_ARGUMENT.name
        self.core.finish(record, None)
        return exc

    async def _deltas(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                      record: RequestRecord, reply: ReplyBudget | None) -> AsyncIterator[Delta]:
        """The core's run of a gRPC call: its tenant, deadline and cancellation."""
        tenant = await self._tenant(context, record)
        try:
            converted = request_from_pb(request, self.core.config.max_messages)
        except InvalidArgument as exc:
            raise self._refused(record, exc) from None
        # grpc.aio cancels the handler when the client goes away, but not while grpc itself writes.
        context.add_done_callback(lambda _: record.route.cancel())
        if self.core.tracer is not None:
            INCOMING_TRACEPARENT.set(traceparent_of(context.invocation_metadata()))  # this call's task only
        deltas = self.core.run(converted, record, tenant, context.time_remaining(), reply=reply)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        record = RequestRecord("Generate", request.request_id or uuid.uuid4().hex)
        # One reply holds everything: one that cannot be sent is refused, up front or as it grows.
        budget = ReplyBudget(self.core.config.max_message_bytes)
        return reply_to_pb(await collect(record.request_id, self._deltas(request, context, record, budget)))

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        record = RequestRecord("GenerateStream", request.request_id or uuid.uuid4().hex)
        timeout_s = self.core.config.write_stall_timeout_s
        async with contextlib.aclosing(pieces(self._deltas(request, context, record, None))) as stream:
            async for piece in stream:
                if not await send_within(context.write(piece_to_pb(record.request_id, piece)), timeout_s):
                    self.core.stalled([record])
                    break
            else:
                return
        # The pieces are closed (the backend call cancelled and aborted, the slot released): tell the client.
        raise DeadlineExceededError(f"the client read nothing for {timeout_s} s (write_stall_timeout_s): stream ended")

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        record = RequestRecord("Tokenize", uuid.uuid4().hex)
        tenant = await self._tenant(context, record)
        try:
            converted = tokenize_from_pb(request, self.core.config.max_messages)
        except InvalidArgument as exc:
            raise self._refused(record, exc) from None
        token_ids = await self.core.tokenize(converted, record, tenant)
        return gateway_pb2.TokenizeResponse(token_ids=token_ids, tokens=self.core.require_model().tokens(token_ids))

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        model = self.core.model
        if model is None:
            return gateway_pb2.ListModelsResponse()
        info = model.info
        backends = self.core.backends
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(
            name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            block_size=info.block_size, has_chat_template=model.has_chat_template,
            num_healthy_backends=backends.num_in_rotation(info.model_name), num_backends=backends.num_backends(),
            max_n=info.max_n, max_logprobs=info.max_logprobs, max_stop_strings=info.max_stop_strings)])
