"""The gateway core: one path for every request of every front.

Admission (the tenant's priority cap and a slot, before any await), one ``validate``, tokenizing
off the event loop, dispatch to a backend, the reply-size cap of unary answers, metrics and the
access line: all here, on the core's own types (``gateway.core.types``). The fronts only convert:
the gRPC servicer (``gateway.grpc.servicer``) and the OpenAI HTTP app (``gateway.openai_api.app``) turn
their wire's request into a ``GenerateRequest``, call ``GatewayCore.run`` and turn the deltas back.
The core stands on ports (``gateway.core.ports``): it is handed its backends and its tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.config import GatewayConfig
from gateway.core import tool_parsers, tools
from gateway.core.ports import Backends, Route, Tokenizer
from gateway.core.streaming import ReplyBudget
from gateway.core.types import Delta, GenerateRequest, Usage
from gateway.core.validate import PromptLimits, check_prompt, check_prompt_size, validate
from gateway.metrics import GatewayMetrics
from gateway.tenants import Admission, Tenant, Tenants
from gateway.traces import INCOMING_TRACEPARENT
from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument, UnavailableError
from pagedserve.log import get_logger
from pagedserve.rpc import status_for

if TYPE_CHECKING:
    from pagedserve.tracing import Span, Tracer

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
    usage: Usage = field(default_factory=Usage)
    route: Route = field(default_factory=Route)
    span: Span | None = None  # its trace span, when traces are on (ended by ``GatewayCore.finish``)
    num_completions: int = 1  # its validated n (GenerationParams.n), once validated

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class GatewayCore:
    """Admission, validation, tokenizing, dispatch and accounting for every front of one gateway.

    Args:
        config: limits and logging choices.
        backends: runs requests on the compute services (``gateway.backend.dispatch.Dispatcher``).
        metrics: where requests are counted.
        tenants: who each key is, and admission (its own when None: the config's tenants).
    """

    def __init__(self, config: GatewayConfig, backends: Backends, metrics: GatewayMetrics,
                 tenants: Tenants | None = None) -> None:
        self.config = config
        self.backends = backends
        self.metrics = metrics
        self.tenants = tenants or Tenants(config.tenants, config.max_queued_requests, metrics.tenant_changed)
        self.prompt_limits = PromptLimits(config.max_prompt_chars, config.max_messages)
        self.model: Tokenizer | None = None  # set once a backend's tokenizer is loaded
        # Tokenizing a long prompt takes milliseconds to seconds of CPU: on threads of its own, few
        # of them, so neither the event loop nor the default executor's other work waits on it.
        self.tokenize_executor = ThreadPoolExecutor(config.tokenize_threads, thread_name_prefix="gateway-tokenize")
        self.tracer: Tracer | None = None  # set by the gateway when traces are on (pagedserve/tracing.py)

    @property
    def num_in_flight(self) -> int:
        return self.tenants.num_in_flight

    def close(self) -> None:
        self.tokenize_executor.shutdown(wait=False, cancel_futures=True)

    def require_model(self) -> Tokenizer:
        if self.model is None:
            raise UnavailableError("no backend has been reached yet")
        return self.model

    def tool_parser(self, model: Tokenizer) -> tool_parsers.ToolCallParser:
        """How ``tool_choice: auto`` reads this model's calls (the flag's, or its template's format)."""
        return tool_parsers.choose(self.config.tool_call_parser, model.chat_template_text)

    def admit(self, tenant: Tenant, record: RequestRecord, priority: int | None = None,
              count: int = 1) -> list[Admission]:
        """The tenant's priority check and ``count`` slots, all or none, synchronously (before any await).

        A refusal is answered (metrics, one access line) here.
        Raises:
            PermissionDeniedError: the priority is above the tenant's cap.
            ResourceExhaustedError: the gateway or the tenant has fewer than ``count`` slots free.
        """
        record.tenant = tenant.name
        try:
            if priority is not None:
                tenant.check_priority(priority)
            admissions = self.tenants.admit_many(tenant, count)
        except Exception as exc:  # PermissionDenied, ResourceExhausted: the front answers them
            record.status = status_for(exc).name
            self.finish(record, None)
            raise
        self.metrics.queue_length.set(self.tenants.num_in_flight)
        return admissions

    def release(self, admissions: Iterable[Admission]) -> None:
        for admission in admissions:
            admission.release()
        self.metrics.queue_length.set(self.tenants.num_in_flight)

    async def encode(self, request: GenerateRequest, add_special_tokens: bool | None = None,
                     add_generation_prompt: bool = True) -> list[int]:
        """The tokens of a prompt or chat (its input already checked), on the tokenizer's threads.

        ``add_special_tokens``: None is what generation uses (a prompt gets them, a chat's template
        writes its own). ``add_generation_prompt``: a chat ends with the assistant's turn opened.
        """
        model = self.require_model()
        loop = asyncio.get_running_loop()
        if request.messages:
            messages, tool_specs = tools.template_messages(request, model.renders_tools, self.tool_parser(model))
            return await loop.run_in_executor(self.tokenize_executor, model.encode_chat, messages,
                                              bool(add_special_tokens), tool_specs, add_generation_prompt)
        return await loop.run_in_executor(self.tokenize_executor, model.encode_prompt, request.prompt or "",
                                          add_special_tokens is not False)

    async def tokenize(self, request: GenerateRequest, record: RequestRecord, tenant: Tenant,
                       add_special_tokens: bool | None = None, add_generation_prompt: bool = True) -> list[int]:
        """A prompt's or chat's tokens; admitted like a generation (tokenizing costs this gateway).

        ``add_special_tokens``, ``add_generation_prompt``: see ``encode`` (None: as generation tokenizes it).
        """
        [admission] = self.admit(tenant, record)
        try:
            check_prompt_size(request, self.require_model().info, self.prompt_limits)
            check_prompt(request, self.require_model().info, self.prompt_limits)
            token_ids = await self.encode(request, add_special_tokens, add_generation_prompt)
            record.usage.prompt_tokens = len(token_ids)
            return token_ids
        except Exception as exc:  # the front answers it
            record.status = status_for(exc).name
            raise
        finally:
            self.release([admission])
            self.finish(record, request)

    async def detokenize(self, token_ids: list[int], record: RequestRecord, tenant: Tenant) -> str:
        """The text of token ids (each in the vocabulary); admitted like a generation.

        Raises:
            InvalidArgument: an id outside the vocabulary, or more ids than a prompt may have.
        """
        [admission] = self.admit(tenant, record)
        try:
            model = self.require_model()
            if len(token_ids) > rules.MAX_PROMPT_TOKENS:
                raise InvalidArgument(f"tokens: at most {rules.MAX_PROMPT_TOKENS} ids, got {len(token_ids)}")
            rules.check_token_ids("tokens", token_ids, model.info.vocab_size or None)
            record.usage.prompt_tokens = len(token_ids)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.tokenize_executor, model.decode, token_ids)
        except Exception as exc:  # the front answers it
            record.status = status_for(exc).name
            raise
        finally:
            self.release([admission])
            self.finish(record, None)

    async def run(self, request: GenerateRequest, record: RequestRecord, tenant: Tenant, timeout_s: float | None,
                  *, admission: Admission | None = None, reply: ReplyBudget | None = None, num_prompts: int = 1,
                  max_tokens_to_context: bool = False) -> AsyncIterator[Delta]:
        """Admits, validates and dispatches one request; yields the backend's deltas.

        Admission is the first thing the first ``anext`` does (no await before it), unless the
        front admitted the request already (``admission``: the HTTP API admits a whole prompt list
        at once, before converting any of it).

        Args:
            request: the request as the front converted it.
            record: filled for the access line; ``record.route.cancel()`` ends the request.
            tenant: who sent it (``Tenants.identify`` of its key).
            timeout_s: the client's remaining time (None = no deadline).
            admission: a slot already held for it (released here, whatever happens).
            reply: for a unary answer, the bytes it may carry (refused up front when it cannot fit,
                ended RESOURCE_EXHAUSTED when it grows past); None for a stream.
            num_prompts: the prompts that share ``reply``.
            max_tokens_to_context: a request without max_tokens may generate up to the model's length
                (OpenAI's chat default) instead of the API's default of 16 tokens.
        Raises:
            InvalidArgument, ResourceExhaustedError, PermissionDeniedError, UnavailableError, ...:
            every failure is a ``pagedserve.errors`` type; each front answers it with its status.
        """
        started = time.monotonic()
        if self.tracer is not None:  # the front's traceparent (gateway/traces.py), else a new trace
            record.span = self.tracer.start(f"gateway {record.method}", INCOMING_TRACEPARENT.get(), kind="server",
                                            at=started, attributes={"pagedserve.request_id": record.request_id})
        if admission is None:
            [admission] = self.admit(tenant, record, request.priority)
        record.tenant = tenant.name
        waiting = self.metrics.tenant_waiting.labels(tenant.name)
        is_waiting = False
        try:
            model = self.require_model()
            check_prompt_size(request, model.info, self.prompt_limits)  # before tools are parsed or rendered
            tool_plan = tools.plan(request, self.tool_parser(model))
            request = tools.constrained(request, tool_plan)
            validated = validate(request, model.info, self.prompt_limits, reply, num_prompts)
            sampling = validated.sampling
            record.num_completions = sampling.n
            token_ids = request.prompt_token_ids if request.prompt_token_ids is not None else await self.encode(request)
            if reply is not None and sampling.options.prompt_logprobs is not None:
                reply.check_prompt_scores(len(token_ids), sampling.options.prompt_logprobs)
            # The cache namespace is the tenant's: its hits are on its own prompts only.
            backend_request = validated.to_backend(list(token_ids), tenant.cache_salt(request.cache_salt),
                                                   max_tokens_to_context, tenant.name)
            record.usage.prompt_tokens = len(token_ids)  # until the backend's usage arrives
            if record.span is not None and self.tracer is not None:  # admitted, validated, tokenized
                self.tracer.record("gateway.admission", record.span, started, time.monotonic(), {
                    "pagedserve.tenant": tenant.name, "pagedserve.num_prompt_tokens": len(token_ids)})
            deltas = self.backends.run(backend_request, model.info.model_name, record.route, timeout_s,
                                       record.span)
            if tool_plan is not None:
                deltas = tools.with_tool_calls(deltas, tool_plan, model.token_text)
            waiting.inc()  # until its first answer: the tenant's queue at the backends
            is_waiting = True
            is_scoring = sampling.is_scoring
            # aclosing: a client that goes away closes the backend call now, not at garbage collection.
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    if is_waiting:
                        is_waiting = False
                        waiting.dec()
                    if reply is not None:
                        reply.spend(delta)  # closing the backend call aborts the request there
                    if delta.token_ids:
                        record.usage.completion_tokens += len(delta.token_ids)
                        record.last_token_at = time.perf_counter()
                        record.first_token_at = record.first_token_at or record.last_token_at
                    if delta.usage is not None:
                        record.usage = delta.usage
                    if is_scoring:  # the first delta: the backend's carries the prompt's scores
                        is_scoring = False
                        delta.prompt_logprobs = delta.prompt_logprobs or []  # (none for a one-token prompt)
                        delta.prompt_token_ids = list(token_ids)
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled, its deadline passed, or it stalled
            if record.status == "OK":
                expired = timeout_s is not None and record.elapsed() >= timeout_s
                record.status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        except Exception as exc:  # the front answers it (a bug: INTERNAL, logged with its traceback)
            record.status = status_for(exc).name
            raise
        finally:
            if is_waiting:
                waiting.dec()
            self.release([admission])
            self.finish(record, request)

    def stalled(self, records: Iterable[RequestRecord]) -> None:
        """A stream's client read nothing for ``write_stall_timeout_s``: counted once, its requests
        marked (the front then closes their deltas, which aborts them on the backend)."""
        for record in records:
            record.status = "DEADLINE_EXCEEDED"
        self.metrics.write_stalls.inc()

    def finish(self, record: RequestRecord, request: GenerateRequest | None, path: str | None = None) -> None:
        """Metrics and the access line (no prompt text unless the config asks for it; ``path``: an
        HTTP route no endpoint serves, named in the line)."""
        now = time.perf_counter()
        self.metrics.requests.labels(record.method, record.status).inc()
        ttft = None
        if record.first_token_at is not None and request is not None:
            ttft = record.first_token_at - record.started
            self.metrics.ttft.observe(ttft)
            # Completions of an n > 1 request advance together: time per token of one of them.
            num_tokens = record.usage.completion_tokens / record.num_completions
            if num_tokens > 1 and record.last_token_at is not None:
                self.metrics.tpot.observe((record.last_token_at - record.first_token_at) / (num_tokens - 1))
        extra: dict[str, object] = {} if path is None else {"path": path}
        if self.config.log_prompts and request is not None:
            extra = {"prompt": request.prompt or "", "messages": [m.content for m in request.messages or ()]}
        if record.span is not None and self.tracer is not None:
            self.tracer.end(record.span, error=None if record.status == "OK" else record.status, attributes={
                "pagedserve.tenant": record.tenant, "pagedserve.status": record.status,
                "pagedserve.backend": record.route.backend, "pagedserve.num_prompt_tokens": record.usage.prompt_tokens,
                "pagedserve.num_output_tokens": record.usage.completion_tokens,
                "pagedserve.num_cached_tokens": record.usage.cached_prompt_tokens})
            record.span = None
        log.info("request", request_id=record.request_id, method=record.method, tenant=record.tenant,
                 status=record.status,
                 backend=record.route.backend, attempts=record.route.num_attempts,
                 prompt_tokens=record.usage.prompt_tokens, completion_tokens=record.usage.completion_tokens,
                 cached_prompt_tokens=record.usage.cached_prompt_tokens,
                 ttft_s=None if ttft is None else round(ttft, 4), total_s=round(now - record.started, 4), **extra)
