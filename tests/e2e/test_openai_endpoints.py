"""Additions to both APIs: the endpoints clients probe besides generation (vLLM's
``/tokenize`` and ``/detokenize``, ``/version``, ``/v1/models`` answering only once a backend is
ready) and ``logit_bias`` through the ``openai`` SDK and gRPC.

One gateway with its HTTP front in front of one of the session's engines, talked to with httpx;
its gRPC ``Tokenize`` is the reference (same tokenizer, same template).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import ServiceProcess, wait_until
from pagedserve.sockets import free_port
from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.conftest import Http, http_get

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi </s> there"}]


def _post(http: Http, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{http.base_url}{path}", json=body, timeout=30)


def test_tokenize_a_prompt_and_messages_as_the_grpc_tokenize_does(http: Http, service_model: ServiceModel) -> None:
    reply = _post(http, "/tokenize", {"model": http.model, "prompt": "Hello, wörld"})
    assert reply.status_code == 200, reply.text
    want = http.gateway.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="Hello, wörld"), timeout=10)
    body = reply.json()
    assert body["tokens"] == list(want.token_ids) and body["token_strs"] == list(want.tokens)
    assert body["count"] == len(want.token_ids) and body["max_model_len"] == 1024
    plain = _post(http, "/tokenize", {"prompt": "Hello, wörld", "add_special_tokens": False}).json()
    assert plain["tokens"] == service_model.tokenizer.encode("Hello, wörld", add_special_tokens=False)

    chat = _post(http, "/tokenize", {"model": http.model, "messages": CHAT}).json()
    messages = [gateway_pb2.ChatMessage(**m) for m in CHAT]
    want = http.gateway.stub.Tokenize(gateway_pb2.TokenizeRequest(messages=messages), timeout=10)
    assert chat["tokens"] == list(want.token_ids) and chat["count"] == len(want.token_ids)


def test_detokenize_gives_back_the_text(http: Http, service_model: ServiceModel) -> None:
    text = "Hello, wörld </s>!"
    tokens = _post(http, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    reply = _post(http, "/detokenize", {"model": http.model, "tokens": tokens})
    assert reply.status_code == 200 and reply.json() == {"prompt": text}
    eos = service_model.tokenizer.convert_tokens_to_ids("</s>")
    assert _post(http, "/detokenize", {"tokens": [eos]}).json() == {"prompt": "</s>"}


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, 258]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens"),
])
def test_bad_bodies_are_400_naming_the_parameter(http: Http, path: str, body: dict, param: str) -> None:
    reply = _post(http, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_unknown_model_is_404_and_version_answers(http: Http) -> None:
    for path, body in (("/tokenize", {"model": "nope", "prompt": "x"}), ("/detokenize", {"model": "nope",
                                                                                        "tokens": [1]})):
        reply = _post(http, path, body)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    reply = httpx.get(f"{http.base_url}/version", timeout=10)
    assert reply.status_code == 200 and reply.json()["version"]


def test_models_is_503_until_a_backend_is_ready(run_dir: Path) -> None:
    port, grpc_port = free_port(), free_port()
    # A backend that does not exist: the gateway serves HTTP, but no model is ready.
    process = ServiceProcess("gateway", ["--backend", f"127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{grpc_port}",
                                         "--http-port", str(port), "--health-interval-s", "0.2"],
                             address=f"127.0.0.1:{grpc_port}", log_file=run_dir / "gateway-models-503.log")
    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health") is not None, what="the HTTP front")
        reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["type"] == "server_error"
        assert httpx.get(f"http://127.0.0.1:{port}/version", timeout=5).status_code == 200
        assert httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"prompt": "x"}, timeout=5).status_code == 503
    finally:
        assert process.stop() == 0


def test_models_lists_the_model_once_ready(http: Http) -> None:
    reply = httpx.get(f"{http.base_url}/v1/models", timeout=5)
    assert reply.status_code == 200 and [m["id"] for m in reply.json()["data"]] == [http.model]


# --- logit_bias ---------------------------------------------------------------------------------


def _greedy(http: Http, bias: dict[int, float] | None = None, max_tokens: int = 1) -> list[int]:
    return [lp.token_id for lp in _greedy_logprobs(http, bias, max_tokens)]


def _greedy_logprobs(http: Http, bias: dict[int, float] | None = None,
                     max_tokens: int = 1) -> list[gateway_pb2.TokenLogprobs]:
    params = gateway_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logit_bias=bias,
                                        logprobs=0)
    reply = http.gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt="The quick brown fox", params=params),
                                       timeout=60)
    return list(reply.choices[0].logprobs)


def test_logit_bias_bans_and_forces_tokens_on_both_apis(http: Http, service_model: ServiceModel) -> None:
    decode = service_model.tokenizer.decode
    [greedy] = _greedy_logprobs(http)
    [other] = _greedy_logprobs(http, {greedy.token_id: -100.0})
    assert other.token_id != greedy.token_id and other.logprob < greedy.logprob  # logprobs: the raw logits'
    [forced] = [t for t in service_model.tokenizer.encode("QZ", add_special_tokens=False) if t != greedy.token_id][:1]
    assert _greedy(http, {forced: 100.0}, max_tokens=5) == [forced] * 5

    client = http.client()
    # The SDK's token and its logprob equal gRPC's (a lone byte token's text may read U+FFFD).
    for bias, want in ((None, greedy), ({str(greedy.token_id): -100}, other)):
        reply = client.completions.create(model=http.model, prompt="The quick brown fox", max_tokens=1,
                                          temperature=0, logit_bias=bias, logprobs=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].logprobs.tokens == [decode([want.token_id])]
        assert reply.choices[0].logprobs.token_logprobs == [pytest.approx(want.logprob, abs=1e-5)]
    for seed in range(2):
        reply = client.chat.completions.create(model=http.model, messages=CHAT, max_tokens=4, temperature=1.0,
                                               seed=seed, logit_bias={str(forced): 100},
                                               extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == decode([forced] * 4)


@pytest.mark.parametrize("bias", [{"abc": 1}, {"5": 200}, {"5": -100.5}, {str(i): 1 for i in range(301)},
                                  {"258": 1}, {"-1": 1}])
def test_bad_logit_bias_is_400_naming_it(http: Http, bias: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        http.client().completions.create(model=http.model, prompt="x", max_tokens=1, logit_bias=bias)
    assert info.value.body["param"] == "logit_bias", info.value.body


@pytest.mark.parametrize("bias", [{5: 200.0}, {258: 1.0}, {i: 1.0 for i in range(301)}])
def test_bad_logit_bias_is_invalid_argument_on_grpc(http: Http, bias: dict) -> None:
    params = gateway_pb2.SamplingParams(max_tokens=1, logit_bias=bias)
    with pytest.raises(grpc.RpcError) as info:
        http.gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt="x", params=params), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("params.logit_bias"), info.value.details()


# --- the small gaps real clients hit --------------------------------------------------------------


def test_tokenize_honours_add_generation_prompt_as_vllm_does(http: Http, service_model: ServiceModel) -> None:
    """Read and passed to the template (the e2e model's template writes no generation prompt, so
    the tokens are the same either way: ``test_tokenizer`` has one that does)."""
    chat = [{"role": "user", "content": "count me"}]
    want = service_model.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    closed = _post(http, "/tokenize", {"messages": chat, "add_generation_prompt": False}).json()["tokens"]
    assert closed == list(want)
    assert "add_generation_prompt" not in http.gateway.log_file.read_text()  # not an unknown field


def test_an_unknown_route_is_a_404_saying_so_and_an_access_line(http: Http) -> None:
    reply = httpx.post(f"{http.base_url}/v1/nothing-here", json={"model": http.model}, timeout=10)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] is None and error["message"].startswith("Invalid URL (POST /v1/nothing-here)"), error
    assert "model" not in error["message"]
    wrong_method = httpx.get(f"{http.base_url}/v1/chat/completions", timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] is None
    log = http.gateway.log_file.read_text()
    assert '"method": "OpenAI.UnknownRoute"' in log and "POST /v1/nothing-here" in log, log[-2000:]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [[1, "x"]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": 5}, "tool_choice"),
])
def test_a_wrong_type_names_the_clients_parameter(http: Http, path: str, body: dict, param: str) -> None:
    reply = _post(http, path, body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
