"""``GatewayCore`` on a fake backend (``tests/gateway/fake_backend.py``): admission, validation,
dispatch, stream assembly, cancellation and the status every failure is recorded with, with no
process, no network and no model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.config import GatewayConfig
from gateway.core.service import GatewayCore, RequestRecord
from gateway.core.streaming import ReplyBudget, collect
from gateway.core.types import (BackendRequest, ChatMessage, Completion, Delta, GenerateRequest, ModelInfo, Reply,
                                SamplingOptions, Usage)
from gateway.core.validate import validate
from gateway.metrics import GatewayMetrics
from gateway.tenants import Tenant, Tenants
from pagedserve.errors import (DeadlineExceededError, InvalidArgument, PermissionDeniedError, RequestFailedError,
                               ResourceExhaustedError, UnavailableError)
from pagedserve.rpc import status_for
from tests.gateway.fake_backend import FAKE_ADDRESS, HOLD, ByteTokenizer, Call, FakeBackends

INFO = ModelInfo("fake", max_model_len=64, vocab_size=256)
HI = [104, 105]  # "hi" in the fake's byte tokens
TWO_TOKENS = [Delta(0, "o", [111]), Delta(0, "k", [107], finish_reason="length", usage=Usage(2, 2, 0))]


@pytest.fixture
def backends() -> FakeBackends:
    return FakeBackends(TWO_TOKENS)


@pytest.fixture
def core(backends: FakeBackends) -> Iterator[GatewayCore]:
    core = GatewayCore(GatewayConfig(backends=(FAKE_ADDRESS,), tokenize_threads=1, max_queued_requests=2),
                       backends, GatewayMetrics())
    core.model = ByteTokenizer(INFO)
    yield core
    core.close()


def run(core: GatewayCore, request: GenerateRequest, record: RequestRecord | None = None,
        timeout_s: float | None = None, **kwargs: object) -> list[Delta]:
    """All deltas of one request through ``core.run`` (as the local tenant)."""
    async def drain() -> list[Delta]:
        deltas = core.run(request, record or RequestRecord("Generate", "r1"), core.tenants.local, timeout_s,
                          **kwargs)  # type: ignore[arg-type]
        return [d async for d in deltas]
    return asyncio.run(drain())


def num_answered(core: GatewayCore, status: str, method: str = "Generate") -> float | None:
    return core.metrics.registry.get_sample_value("pagedserve_gateway_requests_total",
                                                  {"method": method, "status": status})


@pytest.mark.parametrize(("options", "message"), [
    (SamplingOptions(top_p=1.5), "params.top_p must be in (0.0, 1.0], got 1.5"),
    (SamplingOptions(temperature=-1.0), "params.temperature must be >= 0.0, got -1.0"),
    (SamplingOptions(max_tokens=0), "params.max_tokens must be >= 1, got 0"),
    (SamplingOptions(n=0), "params.n must be in [1, 64], got 0"),
    (SamplingOptions(stop_token_ids=[300]), "params.stop_token_ids[0] must be in [0, 256), got 300"),
    # The one rule that needs the tokens: checked right after tokenizing, still before the backend.
    (SamplingOptions(max_tokens=63),
     "params.max_tokens: the prompt (2 tokens) plus max_tokens (63) exceeds the model's maximum length (64)"),
])
def test_a_bad_field_is_refused_by_name_before_the_backend_sees_it(core: GatewayCore, backends: FakeBackends,
                                                                   options: SamplingOptions, message: str) -> None:
    record = RequestRecord("Generate", "r1")
    with pytest.raises(InvalidArgument) as caught:
        run(core, GenerateRequest(prompt="hi", options=options), record)
    assert str(caught.value) == message
    assert (record.status, backends.calls, core.num_in_flight) == ("INVALID_ARGUMENT", [], 0)
    assert num_answered(core, "INVALID_ARGUMENT") == 1


def test_validate_resolves_only_the_gateways_own_defaults() -> None:
    """max_tokens and n are resolved once, in validate (the gateway budgets with them); every other
    unset field stays None, for the compute service to resolve from the model's own defaults."""
    unset = validate(GenerateRequest(prompt="hi"), INFO).sampling
    assert (unset.max_tokens, unset.n, unset.is_max_tokens_given, unset.is_scoring) == (16, 1, False, False)
    assert unset.options == SamplingOptions()  # temperature, top_p, seed, ...: still None
    given = SamplingOptions(max_tokens=5, n=3, temperature=0.0, top_p=0.5, seed=7, prompt_logprobs=0)
    sampling = validate(GenerateRequest(prompt="hi", options=given), INFO).sampling
    assert (sampling.max_tokens, sampling.n, sampling.is_max_tokens_given, sampling.is_scoring) == (5, 3, True, True)
    assert sampling.options is given  # travels as the client gave it: a zero temperature stays a value


def test_the_backend_request_carries_the_validated_params_as_they_are() -> None:
    given = SamplingOptions(n=2, top_k=40)
    backend = validate(GenerateRequest(prompt="hi", options=given), INFO).to_backend(HI, "salt")
    assert (backend.options, backend.max_tokens, backend.n) == (given, 16, 2)
    unset = validate(GenerateRequest(prompt="hi"), INFO).to_backend(HI, "salt")
    assert (unset.options, unset.max_tokens, unset.n) == (SamplingOptions(), 16, 1)


@pytest.mark.parametrize(("options", "message"), [
    (SamplingOptions(top_k=1 << 31), "params.top_k must be a 32-bit integer, got 2147483648"),
    (SamplingOptions(max_tokens=4, min_tokens=5), "params.min_tokens must be in [0, 4], got 5"),
    (SamplingOptions(logprobs=21), "params.logprobs must be in [0, 20], got 21"),
    (SamplingOptions(repetition_penalty=0.0), "params.repetition_penalty must be > 0.0, got 0.0"),
])
def test_an_out_of_range_field_gives_no_params_but_invalid_argument_naming_it(options: SamplingOptions,
                                                                              message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate(GenerateRequest(prompt="hi", options=options), INFO)
    assert (str(caught.value), status_for(caught.value).name) == (message, "INVALID_ARGUMENT")


@pytest.mark.parametrize(("request_", "message"), [
    (GenerateRequest(prompt="hi", messages=[ChatMessage("user", "hi")]), "prompt, messages: give exactly one of them"),
    (GenerateRequest(), "prompt, messages: give exactly one of them"),
    (GenerateRequest(prompt="hi", priority=1 << 31), "priority must be a 32-bit integer, got 2147483648"),
    (GenerateRequest(prompt="hi", request_id="a\nb"), "request_id: printable characters only, got 'a\\nb'"),
])
def test_a_bad_request_field_is_refused_by_name(core: GatewayCore, backends: FakeBackends,
                                                request_: GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        run(core, request_)
    assert str(caught.value) == message and backends.calls == []


def test_a_prompt_reaches_the_backend_tokenized_with_its_defaults_resolved(core: GatewayCore,
                                                                           backends: FakeBackends) -> None:
    request = GenerateRequest(prompt="hi", priority=0, cache_salt="s1")
    assert run(core, request, timeout_s=3.0) == TWO_TOKENS
    local = core.tenants.local
    # max_tokens is resolved (the API's default of 16); the options travel as the client left them.
    assert backends.calls == [Call(BackendRequest(HI, SamplingOptions(), 16, 0, local.cache_salt("s1"), "local"),
                                   "fake", 3.0)]


def test_a_chat_reaches_the_backend_through_the_template_and_may_take_the_whole_context(
        core: GatewayCore, backends: FakeBackends) -> None:
    run(core, GenerateRequest(messages=[ChatMessage("user", "hi")]), max_tokens_to_context=True)
    [call] = backends.calls
    assert call.request.prompt_token_ids == list(b"user: hi\nassistant: ")
    assert call.request.max_tokens == INFO.max_model_len - len(b"user: hi\nassistant: ")  # 64 - 20 = 44


def test_token_ids_are_sent_as_they_are_and_tenants_have_namespaces_of_their_own(backends: FakeBackends) -> None:
    tenants = Tenants([Tenant("a", keys=("key-a",)), Tenant("b", keys=("key-b",))], 8)
    core = GatewayCore(GatewayConfig(backends=(FAKE_ADDRESS,), tokenize_threads=1), backends, GatewayMetrics(),
                       tenants)
    core.model = ByteTokenizer(INFO)
    try:
        for key in ("key-a", "key-b"):
            tenant = tenants.identify(key)
            assert tenant is not None

            async def drain(tenant: Tenant = tenant) -> None:
                deltas = core.run(GenerateRequest(prompt_token_ids=[7, 8, 9]), RequestRecord("Generate", "r"),
                                  tenant, None)
                [_ async for _ in deltas]
            asyncio.run(drain())
    finally:
        core.close()
    a, b = backends.calls
    assert (a.request.prompt_token_ids, a.request.tenant, b.request.tenant) == ([7, 8, 9], "a", "b")
    assert a.request.cache_salt != b.request.cache_salt


def test_a_stream_is_assembled_into_one_reply_and_accounted(core: GatewayCore, backends: FakeBackends) -> None:
    backends.script = [Delta(0, "o", [111]), Delta(1, "n", [110]), Delta(1, "o", [111], finish_reason="stop"),
                       Delta(0, "k", [107], finish_reason="length", usage=Usage(2, 4, 1))]
    record = RequestRecord("Generate", "r1")

    async def assemble() -> Reply:
        request = GenerateRequest(prompt="hi", options=SamplingOptions(n=2, max_tokens=2))
        return await collect("r1", core.run(request, record, core.tenants.local, None))
    reply = asyncio.run(assemble())
    assert reply == Reply("r1", [Completion(0, "ok", [111, 107], finish_reason="length"),
                                 Completion(1, "no", [110, 111], finish_reason="stop")], Usage(2, 4, 1))
    assert (record.status, record.usage, record.route.backend, record.route.num_attempts) == (
        "OK", Usage(2, 4, 1), FAKE_ADDRESS, 1)
    assert record.first_token_at is not None and record.last_token_at is not None
    assert (backends.num_closed, core.num_in_flight, num_answered(core, "OK")) == (1, 0, 1)


def test_the_first_delta_of_a_scored_prompt_names_the_prompts_tokens(core: GatewayCore,
                                                                     backends: FakeBackends) -> None:
    deltas = run(core, GenerateRequest(prompt="hi", options=SamplingOptions(prompt_logprobs=0)))
    assert [(d.prompt_token_ids, d.prompt_logprobs) for d in deltas] == [(HI, []), (None, None)]


def test_a_unary_reply_past_its_budget_ends_resource_exhausted_and_closes_the_backend_call(
        core: GatewayCore, backends: FakeBackends) -> None:
    record = RequestRecord("Generate", "r1")
    budget = ReplyBudget(max_bytes=1 << 20)
    budget.used = budget.max_bytes  # the next delta does not fit
    with pytest.raises(ResourceExhaustedError):
        run(core, GenerateRequest(prompt="hi"), record, reply=budget)
    assert (record.status, backends.num_closed, core.num_in_flight) == ("RESOURCE_EXHAUSTED", 1, 0)


def _cancel_after_first_delta(core: GatewayCore, record: RequestRecord, timeout_s: float | None) -> Delta:
    """Starts a request whose backend holds after one delta, then cancels the task reading it."""
    async def scenario() -> Delta:
        first: asyncio.Future[Delta] = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for delta in core.run(GenerateRequest(prompt="hi"), record, core.tenants.local, timeout_s):
                first.set_result(delta)
        task = asyncio.create_task(read())
        delta = await first
        assert core.num_in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return delta
    return asyncio.run(scenario())


def test_a_cancelled_client_ends_the_backend_call_and_frees_its_slot(core: GatewayCore,
                                                                     backends: FakeBackends) -> None:
    backends.script = [Delta(0, "o", [111]), HOLD]
    record = RequestRecord("Generate", "r1")
    assert _cancel_after_first_delta(core, record, None) == Delta(0, "o", [111])
    assert (record.status, backends.num_closed, core.num_in_flight) == ("CANCELLED", 1, 0)
    assert record.usage.completion_tokens == 1 and num_answered(core, "CANCELLED") == 1


def test_a_cancellation_past_the_clients_deadline_is_deadline_exceeded(core: GatewayCore,
                                                                       backends: FakeBackends) -> None:
    backends.script = [Delta(0, "o", [111]), HOLD]
    record = RequestRecord("Generate", "r1")
    _cancel_after_first_delta(core, record, 0.0)
    assert (record.status, backends.num_closed) == ("DEADLINE_EXCEEDED", 1)


def test_route_cancel_reaches_the_running_backend_call_only(core: GatewayCore, backends: FakeBackends) -> None:
    """The servicer's done callback calls ``record.route.cancel()``: the backend's canceller while
    its call runs, nothing once it has ended."""
    backends.script = [Delta(0, "o", [111]), Delta(0, "k", [107])]
    record = RequestRecord("Generate", "r1")

    async def scenario() -> list[int]:
        cancels = []
        async for _ in core.run(GenerateRequest(prompt="hi"), record, core.tenants.local, None):
            record.route.cancel()
            cancels.append(backends.num_cancelled)
        record.route.cancel()
        return [*cancels, backends.num_cancelled]
    assert asyncio.run(scenario()) == [1, 2, 2]


@pytest.mark.parametrize(("error", "status"), [
    (UnavailableError("backend unavailable"), "UNAVAILABLE"),
    (ResourceExhaustedError("the backend's queue is full"), "RESOURCE_EXHAUSTED"),
    (DeadlineExceededError("deadline exceeded"), "DEADLINE_EXCEEDED"),
    (InvalidArgument("params.seed: refused by the backend"), "INVALID_ARGUMENT"),
    (RequestFailedError("the request failed on its backend"), "INTERNAL"),
    (RuntimeError("a bug"), "INTERNAL"),
])
def test_a_backend_failure_reaches_the_front_as_it_is_with_its_status(core: GatewayCore, backends: FakeBackends,
                                                                      error: Exception, status: str) -> None:
    for script in ([error], [Delta(0, "o", [111]), error]):  # before and after the first delta
        backends.script = script
        record = RequestRecord("Generate", "r1")
        with pytest.raises(type(error)) as caught:
            run(core, GenerateRequest(prompt="hi"), record)
        assert caught.value is error and record.status == status
    assert (num_answered(core, status), backends.num_closed, core.num_in_flight) == (2, 2, 0)


def test_admission_refuses_a_priority_above_the_tenants_cap_and_a_full_gateway(backends: FakeBackends) -> None:
    tenants = Tenants([Tenant("a", max_priority=1, keys=("key-a",))], max_in_flight=1)
    core = GatewayCore(GatewayConfig(backends=(FAKE_ADDRESS,), tokenize_threads=1), backends, GatewayMetrics(),
                       tenants)
    core.model = ByteTokenizer(INFO)
    tenant = tenants.identify("key-a")
    assert tenant is not None

    async def attempt(priority: int) -> RequestRecord:
        record = RequestRecord("Generate", "r")
        deltas = core.run(GenerateRequest(prompt="hi", priority=priority), record, tenant, None)
        with pytest.raises((PermissionDeniedError, ResourceExhaustedError)):
            await anext(deltas)
        return record

    async def scenario() -> tuple[str, str]:
        refused = await attempt(2)
        [held] = core.admit(tenant, RequestRecord("Generate", "h"))
        full = await attempt(0)
        core.release([held])
        return refused.status, full.status
    try:
        assert asyncio.run(scenario()) == ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED")
    finally:
        core.close()
    assert (backends.calls, core.num_in_flight) == ([], 0)


def test_nothing_is_served_before_a_backends_tokenizer_is_loaded(core: GatewayCore, backends: FakeBackends) -> None:
    core.model = None
    record = RequestRecord("Generate", "r1")
    with pytest.raises(UnavailableError, match="^no backend has been reached yet$"):
        run(core, GenerateRequest(prompt="hi"), record)
    assert (record.status, backends.calls, core.num_in_flight) == ("UNAVAILABLE", [], 0)


def test_tokenize_and_detokenize_are_admitted_and_checked(core: GatewayCore) -> None:
    local = core.tenants.local
    assert asyncio.run(core.tokenize(GenerateRequest(prompt="hi"), RequestRecord("Tokenize", "t"), local)) == HI
    assert asyncio.run(core.detokenize(HI, RequestRecord("Detokenize", "d"), local)) == "hi"
    record = RequestRecord("Detokenize", "d")
    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(core.detokenize([104, 256], record, local))
    assert str(caught.value) == "tokens[1] must be in [0, 256), got 256"
    assert (record.status, core.num_in_flight) == ("INVALID_ARGUMENT", 0)
