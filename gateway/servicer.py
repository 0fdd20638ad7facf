"""``pagedserve.gateway.v1.Gateway``: validate, tokenize, dispatch, and convert at the edge.

Thin by design: validation rules live in ``validation``, routing and retries in ``dispatch``, the
tenant model in ``tenants``; this module admits a request for its tenant (backpressure, priority),
records its access line and metrics, and turns the compute service's messages into the public ones.

Every RPC that does work (Generate, GenerateStream, Tokenize) is admitted synchronously when it
arrives, before its first await, and released on finish, abort and error alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from gateway.auth import bearer_token
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, Route
from gateway.metrics import GatewayMetrics
from gateway.tenants import Admission, Tenant, Tenants
from gateway.tokenizer import ModelTokenizer
from gateway.validation import (check_length, check_prompt_input, check_prompt_token_ids, check_request,
                                check_unary_reply, to_compute_request)
from pagedserve.compute.v1 import compute_pb2
from pagedserve.errors import DeadlineExceededError, ResourceExhaustedError, UnavailableError
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.log import get_logger
from pagedserve.rpc import status_for

log = get_logger("gateway.access")


@dataclass
class RequestRecord:
    """What the access line and the metrics say about one request."""

    method: str
    request_id: str
    tenant: str = ""
    started: float = field(default_factory=time.perf_counter)
    status: str = "OK"
    first_token_at: float | None = None
    last_token_at: float | None = None
    usage: compute_pb2.Usage = field(default_factory=compute_pb2.Usage)
    route: Route = field(default_factory=Route)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _stop_string(message: compute_pb2.GenerateResponse) -> str:
    return message.stop_string if message.WhichOneof("matched_stop") == "stop_string" else ""


def _logprobs(items: list[compute_pb2.TokenLogprobs]) -> list[gateway_pb2.TokenLogprobs]:
    # The two TokenLogprobs messages have the same fields and numbers: a wire-level copy.
    return [gateway_pb2.TokenLogprobs.FromString(item.SerializeToString()) for item in items]


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7) if value >= 0 else 10


def _reply_bytes(message: compute_pb2.GenerateResponse) -> int:
    """What ``message`` adds to a unary reply on the wire (its ids, text and logprobs entries)."""
    entries = (size + 1 + _varint_bytes(size) for size in (lp.ByteSize() for lp in message.logprobs))
    return sum(map(_varint_bytes, message.token_ids)) + len(message.text.encode()) + sum(entries)


def _usage(usage: compute_pb2.Usage) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                             cached_prompt_tokens=usage.cached_prompt_tokens)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The public service.

    Args:
        config: limits and logging choices.
        dispatcher: sends requests to backends.
        metrics: where requests are counted.
        tenants: who each key is, and admission (its own when None: the config's tenants).
    """

    def __init__(self, config: GatewayConfig, dispatcher: Dispatcher, metrics: GatewayMetrics,
                 tenants: Tenants | None = None) -> None:
        self.config = config
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.tenants = tenants or Tenants(config.tenants, config.max_queued_requests, metrics.tenant_changed)
        self.model: ModelTokenizer | None = None  # set once a backend's tokenizer is loaded
        # Tokenizing a long prompt takes milliseconds to seconds of CPU: on threads of its own, few
        # of them, so neither the event loop nor the default executor's other work waits on it.
        self.tokenize_executor = ThreadPoolExecutor(config.tokenize_threads, thread_name_prefix="gateway-tokenize")

    @property
    def num_in_flight(self) -> int:
        return self.tenants.num_in_flight

    def close(self) -> None:
        self.tokenize_executor.shutdown(wait=False, cancel_futures=True)

    def _model(self) -> ModelTokenizer:
        if self.model is None:
            raise UnavailableError("no backend has been reached yet")
        return self.model

    async def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        tenant = self.tenants.identify(bearer_token(context.invocation_metadata()))
        if tenant is None:  # the interceptor refuses these first; here for a server built without it
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key (authorization: Bearer KEY)")
        return tenant

    def _admit(self, tenant: Tenant, record: RequestRecord,
               request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest,
               priority: int | None = None) -> Admission:
        """The tenant's priority check and a slot, both before any await (see the module docstring)."""
        record.tenant = tenant.name
        try:
            if priority is not None:
                tenant.check_priority(priority)
            admission = self.tenants.admit(tenant)
        except Exception as exc:  # PermissionDenied, ResourceExhausted: the interceptor maps them
            record.status = status_for(exc).name
            self._finish(record, request)
            raise
        self.metrics.queue_length.set(self.tenants.num_in_flight)
        return admission

    def _release(self, admission: Admission) -> None:
        admission.release()
        self.metrics.queue_length.set(self.tenants.num_in_flight)

    async def _encode(self, request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest) -> list[int]:
        given = check_prompt_input(request, self.config)
        model = self._model()
        loop = asyncio.get_running_loop()
        if given.prompt is not None:
            return await loop.run_in_executor(self.tokenize_executor, model.encode_prompt, given.prompt)
        return await loop.run_in_executor(self.tokenize_executor, model.encode_chat, given.messages)

    async def run(self, request: gateway_pb2.GenerateRequest, record: RequestRecord, tenant: Tenant,
                  timeout_s: float | None, prompt_token_ids: list[int] | None = None,
                  max_tokens_to_context: bool = False) -> AsyncIterator[compute_pb2.GenerateResponse]:
        """Admits, validates and dispatches one request; yields the backend's messages.

        The one path of every front (gRPC here, HTTP in ``gateway.openai_api``): the tenant's
        admission, validation, tokenizing, routing, metrics and the access line all happen here, so
        the fronts only convert. Admission is the first thing the first ``anext`` does (no await
        before it).

        Args:
            request: the public request.
            record: filled for the access line; ``record.route.cancel()`` ends the request.
            tenant: who sent it (``Tenants.identify`` of its key).
            timeout_s: the client's remaining time (None = no deadline).
            prompt_token_ids: a prompt given as token ids (an in-process front's; then the request
                carries neither prompt nor messages).
            max_tokens_to_context: a request without max_tokens may generate up to the model's length
                (OpenAI's chat default) instead of the API's default of 16 tokens.
        Raises:
            InvalidArgument, ResourceExhaustedError, PermissionDeniedError, UnavailableError, ...:
            every failure is a ``pagedserve.errors`` type; the gRPC interceptor answers it with its
            code, the HTTP front with the matching status.
        """
        admission = self._admit(tenant, record, request, request.priority)
        try:
            model = self._model()
            check_request(request, model.info)  # cheap checks first: a bad field costs no tokenizing
            reply_limit = None
            if record.method == "Generate":  # one reply holds everything: refuse one that cannot be sent
                reply_limit = self.config.max_message_bytes
                check_unary_reply(request, reply_limit)
            if prompt_token_ids is None:
                token_ids = await self._encode(request)
            else:
                token_ids = check_prompt_token_ids(prompt_token_ids, request, model.info)
            if max_tokens_to_context and not request.params.max_tokens and model.info.max_model_len:
                request.params.max_tokens = max(model.info.max_model_len - len(token_ids), 1)
            check_length(len(token_ids), request, model.info)
            record.usage.prompt_tokens = len(token_ids)  # until the backend's usage arrives
            backend_request = to_compute_request(request, token_ids, "")
            # The cache namespace is the tenant's: its hits are on its own prompts only.
            backend_request.cache_salt = tenant.cache_salt(request.cache_salt)
            messages = self.dispatcher.run(backend_request, model.info.model_name, record.route, timeout_s)
            # aclosing: a client that goes away closes the backend call now, not at garbage collection.
            reply_bytes = 0
            async with contextlib.aclosing(messages):
                async for message in messages:
                    if reply_limit is not None:
                        reply_bytes += _reply_bytes(message)
                        if reply_bytes > reply_limit:  # closing the backend call aborts the request there
                            raise ResourceExhaustedError(
                                f"the reply has grown past the {reply_limit} bytes one unary reply may carry; "
                                f"use GenerateStream")
                    if message.token_ids:
                        record.usage.completion_tokens += len(message.token_ids)
                        record.last_token_at = time.perf_counter()
                        record.first_token_at = record.first_token_at or record.last_token_at
                    if message.HasField("usage"):
                        record.usage.CopyFrom(message.usage)
                    yield message
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled, its deadline passed, or it stalled
            if record.status == "OK":
                expired = timeout_s is not None and record.elapsed() >= timeout_s
                record.status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        except Exception as exc:  # the front answers it (a bug: INTERNAL, logged with its traceback)
            record.status = status_for(exc).name
            raise
        finally:
            self._release(admission)
            self._finish(record, request)

    async def _run(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                   record: RequestRecord) -> AsyncIterator[compute_pb2.GenerateResponse]:
        """``run`` for a gRPC call: its tenant, deadline and cancellation (the interceptor answers errors)."""
        tenant = await self._tenant(context)
        context.add_done_callback(lambda _: record.route.cancel())
        async with contextlib.aclosing(self.run(request, record, tenant, context.time_remaining())) as messages:
            async for message in messages:
                yield message

    def _finish(self, record: RequestRecord,
                request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest) -> None:
        """Metrics and the access line (no prompt text unless the config asks for it)."""
        now = time.perf_counter()
        self.metrics.requests.labels(record.method, record.status).inc()
        ttft = None
        if record.first_token_at is not None and isinstance(request, gateway_pb2.GenerateRequest):
            ttft = record.first_token_at - record.started
            self.metrics.ttft.observe(ttft)
            # Completions of an n > 1 request advance together: time per token of one of them.
            num_tokens = record.usage.completion_tokens / max(request.params.n, 1)
            if num_tokens > 1 and record.last_token_at is not None:
                self.metrics.tpot.observe((record.last_token_at - record.first_token_at) / (num_tokens - 1))
        extra = {}
        if self.config.log_prompts:
            extra = {"prompt": request.prompt, "messages": [m.content for m in request.messages]}
        log.info("request", request_id=record.request_id, method=record.method, tenant=record.tenant,
                 status=record.status,
                 backend=record.route.backend, attempts=record.route.num_attempts,
                 prompt_tokens=record.usage.prompt_tokens, completion_tokens=record.usage.completion_tokens,
                 cached_prompt_tokens=record.usage.cached_prompt_tokens,
                 ttft_s=None if ttft is None else round(ttft, 4), total_s=round(now - record.started, 4), **extra)

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        record = RequestRecord("Generate", request.request_id or uuid.uuid4().hex)
        return await collect(record.request_id, self._run(request, context, record))

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        record = RequestRecord("GenerateStream", request.request_id or uuid.uuid4().hex)
        timeout_s = self.config.write_stall_timeout_s
        async with contextlib.aclosing(pieces(record.request_id, self._run(request, context, record))) as stream:
            async for piece in stream:
                # A write waits while the client's flow-control window is full: a client that reads
                # nothing for timeout_s holds a slot, a backend sequence and its blocks for nothing.
                try:
                    async with asyncio.timeout(timeout_s):  # no task per write, unlike wait_for
                        await context.write(piece)
                except TimeoutError:
                    record.status = "DEADLINE_EXCEEDED"
                    self.metrics.write_stalls.inc()
                    break
            else:
                return
        # The pieces are closed (the backend call cancelled and aborted, the slot released): tell the client.
        raise DeadlineExceededError(f"the client read nothing for {timeout_s} s (write_stall_timeout_s): stream ended")

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        # Admitted like Generate: tokenizing a megabyte costs a backend nothing but this gateway a lot.
        record = RequestRecord("Tokenize", uuid.uuid4().hex)
        admission = self._admit(await self._tenant(context), record, request)
        try:
            token_ids = await self._encode(request)
            record.usage.prompt_tokens = len(token_ids)
            return gateway_pb2.TokenizeResponse(token_ids=token_ids, tokens=self._model().tokens(token_ids))
        except Exception as exc:  # the interceptor answers it
            record.status = status_for(exc).name
            raise
        finally:
            self._release(admission)
            self._finish(record, request)

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        if self.model is None:
            return gateway_pb2.ListModelsResponse()
        info = self.model.info
        pool = self.dispatcher.pool
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(
            name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            block_size=info.block_size, has_chat_template=self.model.has_chat_template,
            num_healthy_backends=len(pool.in_rotation(info.model_name)), num_backends=len(pool.backends),
            max_n=info.max_n, max_logprobs=info.max_logprobs, max_stop_strings=info.max_stop_strings)])


async def collect(request_id: str,
                  messages: AsyncIterator[compute_pb2.GenerateResponse]) -> gateway_pb2.GenerateResponse:
    """The whole answer from a backend's messages: one Completion per index, in index order."""
    choices: dict[int, gateway_pb2.Completion] = {}
    usage = gateway_pb2.Usage()
    async with contextlib.aclosing(messages):
        async for message in messages:
            choice = choices.setdefault(message.index, gateway_pb2.Completion(index=message.index))
            choice.text += message.text
            choice.token_ids.extend(message.token_ids)
            choice.logprobs.extend(_logprobs(message.logprobs))
            if message.finish_reason:
                choice.finish_reason = message.finish_reason
                choice.stop_string = _stop_string(message)
            if message.HasField("usage"):
                usage = _usage(message.usage)
    return gateway_pb2.GenerateResponse(request_id=request_id, choices=[choices[i] for i in sorted(choices)],
                                        usage=usage)


async def pieces(request_id: str, messages: AsyncIterator[compute_pb2.GenerateResponse]
                 ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
    """The public stream from a backend's messages: a piece whenever there is text, an end or usage."""
    # Tokens whose text is not complete yet (half a UTF-8 character) wait for the next piece.
    held_ids: dict[int, list[int]] = {}
    held_logprobs: dict[int, list[compute_pb2.TokenLogprobs]] = {}
    # aclosing: a closed stream (a client gone) closes the backend call at once, not at garbage collection.
    async with contextlib.aclosing(messages):
        async for message in messages:
            ids = held_ids.setdefault(message.index, [])
            logprobs = held_logprobs.setdefault(message.index, [])
            ids.extend(message.token_ids)
            logprobs.extend(message.logprobs)
            if not (message.text or message.finish_reason or message.HasField("usage")):
                continue
            piece = gateway_pb2.GenerateStreamResponse(
                request_id=request_id, index=message.index, text=message.text, token_ids=ids,
                finish_reason=message.finish_reason, logprobs=_logprobs(logprobs), stop_string=_stop_string(message))
            if message.HasField("usage"):
                piece.usage.CopyFrom(_usage(message.usage))
            held_ids[message.index], held_logprobs[message.index] = [], []
            yield piece
