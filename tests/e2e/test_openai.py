"""The OpenAI-compatible HTTP front with the official ``openai`` SDK (sync and async) and raw httpx.

One gateway with ``--http-port`` in front of one of the session's engines (one backend, so a
repeated prompt meets its own prefix cache); its gRPC front is the reference every HTTP answer is
compared with (same request, same gateway, same tokens and logprobs). A second gateway with API
keys and a queue of one answers the auth and backpressure statuses.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from tests.e2e.conftest import Engine, Http, http_get, start_http

KEY = "http-key-0123456789"


@pytest.fixture(scope="module")
def guarded(engines: list[Engine], run_dir: Path) -> Iterator[Http]:
    keys = run_dir / "http-keys.txt"
    keys.write_text(f"{KEY}\n")
    started = start_http(engines, run_dir, "--api-keys-file", str(keys), "--max-queued-requests", "1", key=KEY)
    yield started
    started.gateway.stop()


def _grpc(http: Http, **fields: object) -> gateway_pb2.GenerateResponse:
    return http.gateway.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=60)


def _params(max_tokens: int, **kwargs: object) -> gateway_pb2.SamplingParams:
    return gateway_pb2.SamplingParams(max_tokens=max_tokens, **kwargs)


# --- the SDK: completions and chat, sync and async, streamed and not ----------------------------


def test_models_lists_the_served_model(http: Http) -> None:
    [model] = http.client().models.list().data
    assert model.id == http.model and model.object == "model"
    assert http.client().models.retrieve(http.model).id == http.model


def test_completion_equals_the_grpc_answer_with_logprobs(http: Http, service_model) -> None:
    reply = http.client().completions.create(model=http.model, prompt="The quick brown fox", max_tokens=12,
                                             temperature=0, logprobs=3,
                                             extra_body={"ignore_eos": True, "cache_salt": "http"})
    # Different salts: neither request reuses the other's cached prefix (a cached prefill's float
    # sums differ in the last bits from a full one's).
    expected = _grpc(http, prompt="The quick brown fox", cache_salt="grpc",
                     params=_params(12, temperature=0, logprobs=3, ignore_eos=True))
    [choice], [want] = reply.choices, expected.choices
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert choice.text == want.text and choice.finish_reason == "length" and choice.index == 0
    assert choice.logprobs.token_logprobs == [lp.logprob for lp in want.logprobs]
    # OpenAI's shape is a {token text: logprob} dict: tokens with the same text (two halves of
    # characters both read U+FFFD) collapse into one entry, as they do in vLLM.
    decode = service_model.tokenizer.decode
    assert choice.logprobs.top_logprobs == [{decode([t]): lp for t, lp in zip(w.top_token_ids, w.top_logprobs)}
                                            for w in want.logprobs]
    # Each token's own text (special tokens included: the completion text leaves them out).
    assert choice.logprobs.tokens == [decode([t]) for t in want.token_ids]
    lengths = [len(t) for t in choice.logprobs.tokens]
    assert choice.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens and reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_greedy_equals_grpc_and_transformers(http: Http, service_model) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    reply = http.client().chat.completions.create(model=http.model, messages=messages, max_completion_tokens=16,
                                                  temperature=0, extra_body={"ignore_eos": True})
    expected = _grpc(http, messages=[gateway_pb2.ChatMessage(**m) for m in messages],
                     params=_params(16, temperature=0, ignore_eos=True))
    [choice] = reply.choices
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == expected.choices[0].text
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 16
    ids = service_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        want = service_model.hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=16,
            min_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert list(expected.choices[0].token_ids) == want
    assert reply.usage.prompt_tokens == len(ids)


def test_chat_stream_shape_and_usage_only_when_asked(http: Http) -> None:
    messages = [{"role": "user", "content": "stream me"}]
    whole = http.client().chat.completions.create(model=http.model, messages=messages, max_tokens=10, temperature=0,
                                                  n=2, extra_body={"ignore_eos": True})
    chunks = list(http.client().chat.completions.create(
        model=http.model, messages=messages, max_tokens=10, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 20 and last.usage.prompt_tokens > 0
    assert all(len(c.choices) == 1 and c.usage is None for c in body)
    for index in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert [c.finish_reason for c in mine].count("length") == 1 and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[index].message.content
    # Without include_usage (and with stream_options: {}), no usage at all.
    for options in (None, {}):
        plain = list(http.client().chat.completions.create(model=http.model, messages=messages, max_tokens=4,
                                                           stream=True, stream_options=options))
        assert all(c.usage is None and len(c.choices) == 1 for c in plain)


def test_completions_batch_stream_and_stop_strings(http: Http) -> None:
    client = http.client()
    base = client.completions.create(model=http.model, prompt=["one", "two"], max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in base.choices] == [0, 1] and base.usage.completion_tokens == 16
    text = base.choices[0].text
    stop = text[3:5]  # a string the greedy output contains
    assert stop and stop in text
    stopped = client.completions.create(model=http.model, prompt="one", max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[:text.index(stop)]
    streamed = list(client.completions.create(model=http.model, prompt=["one", "two"], max_tokens=8, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in streamed if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == base.choices[index].text
        assert [c.finish_reason for c in mine].count("length") == 1
    # A prompt as token ids is the same prompt.
    ids = list(http.gateway.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="one"), timeout=10).token_ids)
    by_ids = client.completions.create(model=http.model, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == text


def test_seed_reproducible_and_n_samples(http: Http) -> None:
    client = http.client()

    def sample(seed: int) -> list[str]:
        reply = client.completions.create(model=http.model, prompt="seeded", max_tokens=12, temperature=1.0, n=3,
                                          seed=seed, extra_body={"ignore_eos": True})
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first and len(first) == 3
    assert sample(8) != first


def test_chat_logprobs_equal_grpc(http: Http) -> None:
    messages = [{"role": "user", "content": "logprobs please"}]
    reply = http.client().chat.completions.create(model=http.model, messages=messages, max_tokens=6, temperature=0,
                                                  logprobs=True, top_logprobs=2,
                                                  extra_body={"ignore_eos": True, "cache_salt": "http"})
    expected = _grpc(http, messages=[gateway_pb2.ChatMessage(**m) for m in messages], cache_salt="grpc",
                     params=_params(6, temperature=0, logprobs=2, ignore_eos=True))
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == [lp.logprob for lp in expected.choices[0].logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        list(lp.top_logprobs) for lp in expected.choices[0].logprobs]
    assert all(bytes(c.bytes) == c.token.encode() for c in content)


def test_cached_tokens_on_a_repeated_prompt(http: Http) -> None:
    prompt = "a long shared prefix that fills more than two blocks of sixteen tokens each " * 2
    first = http.client().completions.create(model=http.model, prompt=prompt, max_tokens=2)
    again = http.client().completions.create(model=http.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Whole blocks only (16 tokens each), and never the last prompt token (its logits are needed).
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_async_client_streams_and_not(http: Http) -> None:
    async def main() -> tuple[str, str]:
        async with http.async_client() as client:
            kwargs = dict(model=http.model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                          temperature=0, extra_body={"ignore_eos": True})
            whole = await client.chat.completions.create(**kwargs)
            stream = await client.chat.completions.create(**kwargs, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(main())
    assert whole == streamed and whole


# --- errors: each status, as OpenAI error objects -----------------------------------------------


def test_bad_parameters_are_400_naming_them(http: Http) -> None:
    client = http.client()
    for kwargs, param in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"),
                          ({"max_tokens": 100000}, "max_tokens"), ({"extra_body": {"top_k": -5}}, "top_k"),
                          ({"seed": -1}, "seed"), ({"logit_bias": {"5": 101.0}}, "logit_bias"),
                          ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=http.model, prompt="x", **{"max_tokens": 4, **kwargs})
        assert info.value.status_code == 400 and info.value.body["param"] == param, (kwargs, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=http.model, messages=[{"role": "user", "content": "x"}],
                                       functions=[{"name": "f"}])
    assert "not supported" in info.value.body["message"] and info.value.body["param"] == "functions"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=http.model, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=http.model, messages=[{"role": "wizard", "content": "x"}])
    assert info.value.body["param"] == "messages"


def test_unknown_model_is_404_naming_it(http: Http) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        http.client().completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert "gpt-17" in info.value.body["message"] and info.value.body["code"] == "model_not_found"


def test_auth_401_and_backpressure_429(guarded: Http, engines: list[Engine]) -> None:
    for key in ("wrong", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as info:
            guarded.client(key).completions.create(model=guarded.model, prompt="x", max_tokens=2)
        assert info.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200  # probes carry no key
    reply = guarded.client(KEY).completions.create(model=guarded.model, prompt="x", max_tokens=2, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2  # greedy, EOS ignored: a sampled token is an EOS id now and then
    # The queue holds one request: a long stream in it makes the next one a 429.
    stream = guarded.client(KEY).completions.create(model=guarded.model, prompt="x", max_tokens=900, stream=True,
                                                    extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as info:
        guarded.client(KEY).completions.create(model=guarded.model, prompt="x", max_tokens=2)
    assert info.value.status_code == 429 and info.value.body["type"] == "rate_limit_error"
    stream.close()
    wait_until(lambda: engines[0].load().num_running == 0, what="the stream aborted")


def test_two_tenants_have_their_own_limits_priority_caps_and_caches(engines: list[Engine], run_dir: Path) -> None:
    tenants = run_dir / "http-tenants.json"
    tenants.write_text(json.dumps({"tenants": {"team-a": {"keys": ["KEY-A-0123456789"], "max_concurrent": 1,
                                                          "max_priority": 2},
                                               "team-b": {"keys": ["KEY-B-0123456789"], "max_concurrent": 1}}}))
    served = start_http(engines, run_dir, "--api-keys-file", str(tenants), key="KEY-A-0123456789")
    a, b = served.client("KEY-A-0123456789"), served.client("KEY-B-0123456789")
    try:
        prompt = "the same prompt, long enough to fill two blocks of sixteen tokens for the cache " * 2
        first = a.completions.create(model=served.model, prompt=prompt, max_tokens=2)
        again = a.completions.create(model=served.model, prompt=prompt, max_tokens=2)
        other = b.completions.create(model=served.model, prompt=prompt, max_tokens=2)
        # Each tenant's prompts are cached in its own namespace: B does not hit A's blocks.
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert other.usage.prompt_tokens_details.cached_tokens == 0 == first.usage.prompt_tokens_details.cached_tokens
        with pytest.raises(openai.PermissionDeniedError) as info:  # above team-a's max_priority
            a.completions.create(model=served.model, prompt="x", max_tokens=2, extra_body={"priority": 5})
        assert info.value.status_code == 403 and "priority" in info.value.body["message"]
        stream = a.completions.create(model=served.model, prompt="x", max_tokens=900, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as info:  # team-a holds its one slot
            a.completions.create(model=served.model, prompt="x", max_tokens=2)
        assert "max_concurrent" in info.value.body["message"]
        assert b.completions.create(model=served.model, prompt="x", max_tokens=2).usage.completion_tokens == 2
        stream.close()
        wait_until(lambda: engines[0].load().num_running == 0, what="the stream aborted")
        access = [json.loads(line) for line in served.gateway.log_file.read_text().splitlines()
                  if '"gateway.access"' in line]
        assert {e["tenant"] for e in access if e["method"] == "OpenAI.Completions"} == {"team-a", "team-b"}
    finally:
        served.gateway.stop()


def test_https_with_the_grpc_fronts_certificate(engines: list[Engine], run_dir: Path, tmp_path: Path) -> None:
    from tests.e2e.test_gateway_tls import _self_signed

    cert, key = _self_signed(tmp_path)
    port, grpc_port = free_port(), free_port()
    from pagedserve.process import ServiceProcess

    process = ServiceProcess("gateway", ["--backend", engines[0].address, "--listen", f"127.0.0.1:{grpc_port}",
                                         "--http-port", str(port), "--tls-cert", str(cert), "--tls-key", str(key),
                                         "--health-interval-s", "0.2", "--grace-period-s", "5"],
                             address=f"127.0.0.1:{grpc_port}", log_file=run_dir / "gateway-https.log")
    try:
        url, trust = f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=str(cert))
        wait_until(lambda: (http_get(f"{url}/health", verify=trust) or httpx.Response(0)).status_code == 200,
                   timeout_s=60, what="HTTPS serving")
        # A client that closes its connections (an idle TLS one held open keeps a stopping gateway
        # waiting for its close_notify, up to the grace period).
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(verify=trust)) as client:
            reply = client.completions.create(model=client.models.list().data[0].id, prompt="tls", max_tokens=3,
                                              extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        assert http_get(f"http://127.0.0.1:{port}/health") is None  # no plaintext on the TLS port
    finally:
        assert process.stop() == 0


def test_no_backend_is_503(engines: list[Engine], run_dir: Path) -> None:
    port = free_port()
    # A backend that does not exist: the gateway starts (NOT_SERVING) and its HTTP front answers 503.
    from pagedserve.process import ServiceProcess

    grpc_port = free_port()
    process = ServiceProcess("gateway", ["--backend", f"127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{grpc_port}",
                                         "--http-port", str(port), "--health-interval-s", "0.2"],
                             address=f"127.0.0.1:{grpc_port}", log_file=run_dir / "gateway-503.log")
    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health") is not None, what="the HTTP front")
        assert http_get(f"http://127.0.0.1:{port}/health").status_code == 503
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="m", prompt="x", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["type"] == "server_error"
    finally:
        assert process.stop() == 0


def test_sigterm_lets_an_http_stream_finish_and_health_says_503(engines: list[Engine], run_dir: Path) -> None:
    draining = start_http(engines, run_dir, "--drain-delay-s", "2")
    wait_until(lambda: draining.gateway.num_healthy_backends() == 1, what="the backend in rotation")
    body = {"prompt": "drain", "max_tokens": 900, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{draining.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(lines)
        draining.gateway.process.send_signal(signal.SIGTERM)
        # NOT_SERVING at once (load balancers stop sending), while the drain delay still serves.
        wait_until(lambda: httpx.get(f"{draining.base_url}/health", timeout=5).status_code == 503, timeout_s=5,
                   what="/health 503")
        rest = [line for line in lines if line]
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line.startswith("data: {")]
    assert rest[-1] == "data: [DONE]" and chunks[-1]["usage"]["completion_tokens"] == 900
    assert draining.gateway.process.proc.wait(timeout=30) == 0
    draining.gateway.channel.close()


# --- raw HTTP edge cases ------------------------------------------------------------------------


def test_raw_edge_cases_are_4xx_and_the_gateway_keeps_serving(http: Http) -> None:
    url = f"{http.base_url}/v1/completions"
    with httpx.Client(timeout=30) as client:
        cases = [
            (client.post(url, content=b'{"prompt": "x", ', headers={"content-type": "application/json"}), 400),
            (client.post(url, content=b'[1, 2]', headers={"content-type": "application/json"}), 400),
            (client.post(url, json={"prompt": "x", "max_tokens": "many"}), 400),
            (client.post(url, json={"prompt": {"a": 1}}), 400),
            (client.post(url, json={"max_tokens": 2}), 400),
            (client.post(url, content=b'prompt=x', headers={"content-type": "application/x-www-form-urlencoded"}), 415),
            (client.post(url, json={"prompt": "x" * (10 << 20)}), 413),
            (client.get(url), 405),
            (client.post(f"{http.base_url}/v2/nothing", json={}), 404),
        ]
        for response, status in cases:
            assert response.status_code == status, (status, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert cases[2][0].json()["error"]["param"] == "max_tokens"
        # Unknown fields are accepted (and logged).
        ok = client.post(url, json={"prompt": "x", "max_tokens": 2, "some_future_field": {"a": 1}})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        # Keep-alive: many requests over one connection.
        for _ in range(20):
            response = client.post(url, json={"prompt": "k", "max_tokens": 1})
            assert response.status_code == 200
        assert client.get(f"{http.base_url}/health").json() == {"status": "ok"}
    log = http.gateway.log_file.read_text()
    assert "openai_unknown_fields" in log and "some_future_field" in log
    # The same metrics as the gRPC front's, by method and status (a body refused before it is a
    # request, as a malformed protobuf on gRPC, is not counted; a rule it breaks is).
    assert httpx.post(url, json={"prompt": "x", "temperature": -1}).status_code == 400
    metrics = httpx.get(f"http://127.0.0.1:{http.gateway.metrics_port}/metrics").text
    assert 'pagedserve_gateway_requests_total{method="OpenAI.Completions",status="OK"}' in metrics
    assert 'pagedserve_gateway_requests_total{method="OpenAI.Completions",status="INVALID_ARGUMENT"}' in metrics


def test_a_response_is_not_held_back_by_nagle(http: Http) -> None:
    """Headers and body leave together: with Nagle's algorithm on, the body waited for the client's
    delayed ACK, 40-50 ms after the headers, on every request (accepted sockets lacked TCP_NODELAY)."""
    with socket.create_connection(("127.0.0.1", http.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        gaps = []
        for _ in range(7):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            data, first = b"", None
            while not data.endswith(b'{"status":"ok"}'):
                data += sock.recv(65536)
                first = first or time.perf_counter()
            gaps.append(time.perf_counter() - first)
    assert sorted(gaps)[3] < 0.02, gaps


def test_raw_sse_lines(http: Http) -> None:
    body = {"model": http.model, "messages": [{"role": "user", "content": "sse"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{http.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_disconnect_mid_stream_aborts_and_frees_the_blocks(http: Http, engines: list[Engine]) -> None:
    engine = engines[0]
    wait_until(lambda: engine.load().num_running == 0, what="an idle engine")
    baseline = engine.num_used_blocks()
    body = {"prompt": "disconnect me", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{http.base_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.load().num_running == 1 and engine.num_used_blocks() > baseline
    # The connection closed after one chunk of 900 tokens: the request is aborted, its blocks freed.
    wait_until(lambda: engine.load().num_running == 0 and engine.num_used_blocks() == baseline, timeout_s=10,
               what="the request aborted and its blocks freed")
    # The same for a non-streamed request cut off while it generates.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{http.base_url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    wait_until(lambda: engine.load().num_running == 0 and engine.num_used_blocks() == baseline, timeout_s=10,
               what="the unary request aborted")
    cancelled = [json.loads(line) for line in http.gateway.log_file.read_text().splitlines()
                 if '"OpenAI.Completions"' in line and '"CANCELLED"' in line]
    assert len(cancelled) >= 2
