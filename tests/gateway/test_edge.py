"""The gateway's edge, without processes: request validation and conversion, API-key checks, config
and backend address parsing, DNS discovery (a real lookup of localhost)."""

from __future__ import annotations

import asyncio

import pytest

from compute_service.service.convert import params_from_pb
from gateway.auth import bearer_token
from gateway.backend.compute_convert import model_info_from_pb, to_compute_request
from gateway.backend.pool import BackendPool
from gateway.config import API_KEYS_ENV, GatewayConfig, parse_backend
from gateway.core.types import ChatMessage, GenerateRequest, ModelInfo
from gateway.core.validate import PromptLimits, ValidatedRequest, check_prompt, validate
from gateway.grpc.convert import request_from_pb
from gateway.tenants import Tenant, Tenants
from pagedserve.compute.v1 import compute_pb2
from pagedserve.errors import InvalidArgument
from pagedserve.gateway.v1 import gateway_pb2

INFO = model_info_from_pb(compute_pb2.InfoResponse(model_name="m", max_model_len=64, vocab_size=100, max_n=4,
                                                   max_logprobs=5, max_stop_strings=2))
LIMITS = PromptLimits(max_prompt_chars=50, max_messages=3)


def _request(**params: object) -> GenerateRequest:
    """A public gRPC request with these sampling fields, as the gRPC edge converts it."""
    return request_from_pb(gateway_pb2.GenerateRequest(prompt="hi", params=gateway_pb2.SamplingParams(**params)), 8)


def check_request(request: GenerateRequest, info: ModelInfo = INFO) -> ValidatedRequest:
    return validate(request, info, LIMITS)


def check_prompt_input(request: gateway_pb2.GenerateRequest) -> None:
    check_prompt(request_from_pb(request, LIMITS.max_messages), INFO, LIMITS)


@pytest.mark.parametrize(("params", "named"), [
    ({"temperature": float("nan")}, "params.temperature"),
    ({"top_p": 1.5}, "params.top_p"),
    ({"top_k": -1}, "params.top_k"),
    ({"min_p": 2.0}, "params.min_p"),
    ({"presence_penalty": 3.0}, "params.presence_penalty"),
    ({"n": 5}, "params.n"),
    ({"logprobs": 6}, "params.logprobs"),
    ({"stop": ["a", "b", "c"]}, "params.stop"),
    ({"stop": [""]}, "params.stop[0]"),
    ({"stop_token_ids": [100]}, "params.stop_token_ids[0]"),
    ({"min_tokens": 20, "max_tokens": 10}, "params.min_tokens"),
    ({"max_tokens": -1}, "params.max_tokens"),
    # Counts before contents: one over the limit is refused without a look at the ids.
    ({"stop_token_ids": [1] * 1025}, "params.stop_token_ids: at most 1024 ids, got 1025"),
    ({"stop": ["x" * 257]}, "params.stop[0]"),
    ({"repetition_penalty": -1.0}, "params.repetition_penalty"),
])
def test_each_bad_field_is_named(params: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_request(_request(**params), INFO)


@pytest.mark.parametrize("params", [
    {}, {"temperature": 0.0}, {"top_p": 0.5}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 1.5}, {"n": 0}, {"n": 64},
    {"n": 65}, {"n": -1}, {"logprobs": 20}, {"logprobs": 21}, {"stop": ["a"] * 16}, {"stop": ["a"] * 17},
    {"stop": ["x" * 256]}, {"stop": ["x" * 257]}, {"stop_token_ids": [1] * 1024}, {"stop_token_ids": [1] * 1025},
    {"stop_token_ids": [-1]}, {"max_tokens": 8, "min_tokens": 9}, {"presence_penalty": 2.5},
    {"frequency_penalty": -2.0}, {"repetition_penalty": 0.5}, {"temperature": -1.0}, {"seed": 2**64 - 1},
])
def test_gateway_and_compute_service_agree(params: dict) -> None:
    """One set of rules: whatever the gateway accepts, the compute service accepts (and the other way
    round), because both check with pagedserve.sampling_rules (they had drifted apart before)."""
    info = model_info_from_pb(compute_pb2.InfoResponse(max_model_len=4096, vocab_size=1000))  # the default limits

    def verdict(check) -> bool:
        try:
            check()
        except InvalidArgument:
            return False
        return True

    request = _request(**params)
    at_gateway = verdict(lambda: check_request(request, info))
    at_compute = verdict(lambda: params_from_pb(to_compute_request(check_request(request, info).to_backend([1], ""),
                                                                   "id").params))
    assert at_gateway == at_compute, params


def test_long_role_is_echoed_short() -> None:
    role = "r" * 1_000_000
    with pytest.raises(InvalidArgument) as info:
        check_prompt_input(gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role=role)]))
    assert str(info.value).startswith("messages[0].role must be one of") and len(str(info.value)) < 160
    assert str(info.value).endswith("...")


def test_prompt_input_rules() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        check_prompt_input(gateway_pb2.GenerateRequest())
    with pytest.raises(ValueError, match="exactly one"):
        check_prompt_input(gateway_pb2.GenerateRequest(prompt="x", messages=[gateway_pb2.ChatMessage(role="user")]))
    with pytest.raises(ValueError, match="prompt: at most 50"):
        check_prompt_input(gateway_pb2.GenerateRequest(prompt="x" * 51))
    with pytest.raises(ValueError, match="messages: at most 3"):  # counted at the edge, before any is copied
        request_from_pb(gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user")] * 4), 3)
    with pytest.raises(ValueError, match="messages: at most 3"):
        check_prompt(GenerateRequest(messages=[ChatMessage("user", "")] * 4), INFO, LIMITS)
    check_prompt_input(gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="yo")]))
    with pytest.raises(ValueError, match="request_id"):
        check_request(request_from_pb(gateway_pb2.GenerateRequest(prompt="x", request_id="a\nb"), 8))
    with pytest.raises(ValueError, match=r"prompt\[1\] must be in \[0, 100\)"):
        check_request(GenerateRequest(prompt_token_ids=[1, 100]))


def test_length_is_checked_after_tokenizing() -> None:
    check_request(_request(max_tokens=16)).to_backend([1] * 48, "")
    with pytest.raises(ValueError, match=r"params.max_tokens: the prompt \(49 tokens\)"):
        check_request(_request(max_tokens=16)).to_backend([1] * 49, "")
    with pytest.raises(ValueError, match="prompt: tokenizes to no tokens"):
        check_request(_request()).to_backend([], "")
    # A chat without max_tokens may run to the model's length (OpenAI's default there).
    assert check_request(_request()).to_backend([1] * 40, "", max_tokens_to_context=True).max_tokens == 24


def test_conversion_keeps_unset_apart_from_zero() -> None:
    default = to_compute_request(check_request(_request()).to_backend([1, 2], ""), "id").params
    assert default.max_tokens == 16 and not default.HasField("temperature") and not default.HasField("top_p")
    assert not default.HasField("logprobs") and not default.HasField("seed")
    greedy = to_compute_request(check_request(_request(temperature=0.0, logprobs=0, seed=0, top_p=0.5))
                                .to_backend([1], ""), "id")
    assert greedy.params.HasField("temperature") and greedy.params.temperature == 0.0
    assert greedy.params.HasField("logprobs") and greedy.params.HasField("seed") and greedy.params.top_p == 0.5
    assert list(greedy.prompt_token_ids) == [1] and greedy.request_id == "id"


def test_the_compute_request_sets_only_what_the_client_set() -> None:
    """The wire contract: a field the client left unset reaches the compute service unset (absent, or
    the plain fields' zero), so it resolves the model's own defaults (generation_config.json); only
    max_tokens, the gateway's own default, is always sent."""
    unset = to_compute_request(check_request(_request()).to_backend([1], ""), "id").params
    assert [f.name for f, _ in unset.ListFields()] == ["max_tokens"] and unset.max_tokens == 16
    validated = check_request(_request(temperature=0.0, n=2, top_k=5, seed=0))
    assert (validated.sampling.options.temperature, validated.sampling.n) == (0.0, 2)
    given = to_compute_request(validated.to_backend([1], ""), "id").params
    assert {f.name for f, _ in given.ListFields()} == {"max_tokens", "temperature", "top_k", "seed", "n"}
    assert (given.temperature, given.top_k, given.seed, given.n) == (0.0, 5, 0, 2)


def test_api_keys_bearer_only_exact_match() -> None:
    one, two = Tenant("one", keys=("k1-secret",)), Tenant("two", keys=("k2-secret",))
    tenants = Tenants([one, two], 8)
    assert tenants.identify(bearer_token([("authorization", "Bearer k2-secret")])) is two
    assert tenants.identify(bearer_token([("authorization", "bearer  k1-secret ")])) is one
    for metadata in ([], [("authorization", "k1-secret")], [("authorization", "Bearer k1-secre")],
                     [("authorization", "Bearer ")], [("x-api-key", "k1-secret")]):
        assert tenants.identify(bearer_token(metadata)) is None


def test_config_reads_keys_from_file_and_environment(tmp_path, monkeypatch) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\n\nfile-key\n")
    monkeypatch.setenv(API_KEYS_ENV, "env-a, env-b")
    tenants = GatewayConfig(backends=("h:1",), api_keys_file=str(path)).tenants
    assert [(t.name, t.keys) for t in tenants] == [("key-1", ("env-a",)), ("key-2", ("env-b",)),
                                                   ("key-3", ("file-key",))]
    path.write_text("# nothing\n")
    monkeypatch.delenv(API_KEYS_ENV)
    with pytest.raises(ValueError, match="holds no key"):
        GatewayConfig(backends=("h:1",), api_keys_file=str(path))


def test_backend_addresses() -> None:
    assert parse_backend("unix:/run/c.sock") == ("unix", "/run/c.sock", 0)
    assert parse_backend("dns:engine.llm.svc:50052") == ("dns", "engine.llm.svc", 50052)
    assert parse_backend("[::1]:50052") == ("static", "[::1]", 50052)
    for bad in ("unix:", "host", "host:0", "dns:name", "host:port"):
        with pytest.raises(ValueError, match="backend"):
            parse_backend(bad)


def test_dns_backends_are_every_address_the_name_resolves_to() -> None:
    async def resolve() -> set[str]:
        pool = BackendPool(GatewayConfig(backends=("dns:localhost:50099", "127.0.0.1:50100")), lambda _: None)
        await pool.resolve()
        found = set(pool.backends)
        await pool.close()
        return found

    found = asyncio.run(resolve())
    assert "127.0.0.1:50099" in found and "127.0.0.1:50100" in found
    assert found <= {"127.0.0.1:50099", "[::1]:50099", "127.0.0.1:50100"}


def test_unset_fields_mean_the_same_defaults_everywhere() -> None:
    """One function (sampling_rules.resolve_sampling) says what unset means, for the
    gateway's gRPC and HTTP edges, the compute service's edge and the engine's SamplingParams."""
    from dataclasses import asdict

    from compute_service.engine.sampling_params import SamplingParams
    from gateway.openai_api import convert
    from gateway.openai_api.schema import ChatCompletionRequest, CompletionRequest
    from pagedserve import sampling_rules as rules

    defaults = rules.resolve_sampling({})
    assert defaults == dict(rules.SAMPLING_DEFAULTS)
    engine = {k: v for k, v in asdict(SamplingParams()).items() if k in defaults}
    assert engine == defaults
    assert params_from_pb(compute_pb2.SamplingParams()) == SamplingParams()
    grpc_request = request_from_pb(gateway_pb2.GenerateRequest(prompt="x"), 8)
    [completion] = convert.completion_prompts(CompletionRequest.model_validate({"prompt": "x"}), "c")
    chat = convert.chat_prompt(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}),
                               "c")
    for request in (grpc_request, completion.request, chat.request):
        resolved = check_request(request).params
        assert {**resolved, "stop": tuple(resolved["stop"]), "stop_token_ids": tuple(resolved["stop_token_ids"])} \
            == defaults
    sent = to_compute_request(check_request(grpc_request).to_backend([1], ""), "id").params
    assert params_from_pb(sent) == SamplingParams()


def test_shared_messages_are_one_class_and_the_reply_size_is_exact() -> None:
    """ChoiceList, TokenLogprobs and Usage live in common.proto, re-exported."""
    from gateway.core.streaming import delta_bytes
    from gateway.core.types import Delta, TokenLogprobs
    from gateway.grpc.convert import logprobs_to_pb

    assert gateway_pb2.Usage is compute_pb2.Usage and gateway_pb2.TokenLogprobs is compute_pb2.TokenLogprobs
    assert gateway_pb2.ChoiceList is compute_pb2.ChoiceList
    assert gateway_pb2.Usage.DESCRIPTOR.full_name == "pagedserve.common.v1.Usage"
    # The reply budget's measure is the public reply's bytes, as protobuf counts them.
    items = [TokenLogprobs(5, -0.25, [5, 300, 70000], [-0.25, -1.5, float("-inf")]), TokenLogprobs(0, 0.0),
             TokenLogprobs(2**31 - 1, -3.0, [0], [0.0])]
    delta = Delta(0, "héllo", [5, 300, 70000], items)
    completion = gateway_pb2.Completion(text=delta.text, token_ids=delta.token_ids, logprobs=logprobs_to_pb(items))
    # Less the text and token_ids fields' tags and lengths (once per completion, not per delta).
    assert delta_bytes(delta) == completion.ByteSize() - 4
