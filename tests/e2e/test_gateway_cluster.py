"""The gateway end to end from Python stubs: two engines behind one gateway (and two gateways),
prefix affinity, cancellation, deadlines, metrics, access logs, and a backend killed mid-stream.

Every process is real (memory and compute services with a tiny random model, gateways); the test
that kills a compute service runs last in this module and restarts it, which also proves that a
recovered backend rejoins the rotation.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from tests.e2e.conftest import Engine, Gateway, start_gateway


LONG_MAX_TOKENS = 960


def _params(max_tokens: int = 16, **kwargs: object) -> gateway_pb2.SamplingParams:
    return gateway_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def _long(prompt: str) -> gateway_pb2.GenerateRequest:
    """A request that streams for seconds: no EOS, most of the tiny model's 1024-token context (the
    fused CPU path runs the tiny model at hundreds of tokens per second: 200 tokens took < 0.5 s).
    It samples: a greedy one would take several tokens a step (speculative drafts) and end sooner."""
    return gateway_pb2.GenerateRequest(prompt=prompt, params=gateway_pb2.SamplingParams(
        max_tokens=LONG_MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True))


def _queries(engines: list[Engine]) -> list[int]:
    return [e.memory_stats().prefix_cache_queries for e in engines]


def _metrics(gateway: Gateway) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5).read().decode()


def _reported_pending_tokens(gateway: Gateway, backend: str) -> float:
    """The tokens ``backend`` reported pending at the gateway's last poll of it."""
    [sample] = [s for family in text_string_to_metric_families(_metrics(gateway)) for s in family.samples
                if s.name == "pagedserve_gateway_backend_pending_tokens" and s.labels["backend"] == backend]
    return sample.value


def test_greedy_through_the_gateway_equals_transformers(gateway: Gateway, service_model) -> None:
    prompt = "The quick brown fox"
    reply = gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=_params(24, ignore_eos=True)),
                                  timeout=60)
    ids = service_model.tokenizer.encode(prompt, add_special_tokens=True)
    with torch.no_grad():
        expected = service_model.hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=24,
            min_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    [choice] = reply.choices
    assert list(choice.token_ids) == expected
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 24


def test_stream_pieces_concatenate_to_the_unary_text(gateway: Gateway) -> None:
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="héllo wörld €")],
                                          params=_params(40, ignore_eos=True), request_id="mine-1")
    unary = gateway.stub.Generate(request, timeout=60)
    pieces = list(gateway.stub.GenerateStream(request, timeout=60))
    assert all(p.request_id == "mine-1" for p in pieces) and unary.request_id == "mine-1"
    assert all(p.text for p in pieces[:-1])  # one message per new piece of text
    assert "".join(p.text for p in pieces) == unary.choices[0].text
    assert [t for p in pieces for t in p.token_ids] == list(unary.choices[0].token_ids)
    assert pieces[-1].finish_reason == "length" and pieces[-1].usage.completion_tokens == 40


def test_n_completions_logprobs_and_stop_tokens_pass_through(gateway: Gateway) -> None:
    params = gateway_pb2.SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=2, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(prompt="sample me", params=params)
    reply = gateway.stub.Generate(request, timeout=60)
    assert [c.index for c in reply.choices] == [0, 1] and reply.usage.completion_tokens == 16
    for choice in reply.choices:
        assert [lp.token_id for lp in choice.logprobs] == list(choice.token_ids) and len(choice.token_ids) == 8
        assert all(len(lp.top_token_ids) == 2 and lp.logprob <= 0 for lp in choice.logprobs)
    pieces = list(gateway.stub.GenerateStream(request, timeout=60))  # the same seed: the same samples
    for choice in reply.choices:
        mine = [p for p in pieces if p.index == choice.index]
        assert [t for p in mine for t in p.token_ids] == list(choice.token_ids)
        assert "".join(p.text for p in mine) == choice.text and mine[-1].finish_reason == "length"
    greedy = gateway_pb2.GenerateRequest(prompt="stop me", params=_params(8, ignore_eos=True))
    stop_id = gateway.stub.Generate(greedy, timeout=60).choices[0].token_ids[3]
    greedy.params.stop_token_ids.append(stop_id)
    stopped = gateway.stub.Generate(greedy, timeout=60).choices[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 4


def test_concurrent_requests_use_both_backends(gateway: Gateway, engines: list[Engine]) -> None:
    before = _queries(engines)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: gateway.stub.Generate(
            gateway_pb2.GenerateRequest(prompt=f"unique prompt {i}", params=_params(24, ignore_eos=True)),
            timeout=60), range(8)))
    assert all(r.choices[0].finish_reason == "length" for r in replies)
    after = _queries(engines)
    assert all(a > b for a, b in zip(after, before)), "load was not spread over both backends"


def test_prefix_affinity_keeps_a_shared_prefix_on_one_backend(gateway: Gateway, engines: list[Engine]) -> None:
    system = "You are a terse assistant. Answer in one word. " * 2  # ~6 full blocks of 16 bytes
    before = [e.memory_stats().prefix_cache_hits for e in engines]
    replies = [gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt=system + f"Q{i}?", params=_params(4)),
                                     timeout=60) for i in range(6)]
    # Every request after the first found the shared prefix cached: all went to the same backend.
    assert all(r.usage.cached_prompt_tokens >= 5 * 16 for r in replies[1:])
    gained = [e.memory_stats().prefix_cache_hits - b for e, b in zip(engines, before)]
    assert sorted(g > 0 for g in gained) == [False, True]


def test_second_gateway_sees_load_that_another_client_put_on_an_engine(
        gateway: Gateway, engines: list[Engine], run_dir) -> None:
    second = start_gateway([e.address for e in engines], run_dir)
    try:
        wait_until(lambda: second.num_healthy_backends() == 2, what="both backends in rotation")
        busy, idle = engines
        # Long streams sent straight to one engine: load no gateway counted itself.
        with grpc.insecure_channel(busy.address) as channel:
            stub = compute_pb2_grpc.ComputeStub(channel)
            # Sampled: greedy streams of a repeated prompt would be drafted (speculative decoding) and end early.
            streams = [stub.Generate(compute_pb2.GenerateRequest(
                prompt_token_ids=[65 + i] * 20,
                params=compute_pb2.SamplingParams(max_tokens=LONG_MAX_TOKENS, ignore_eos=True, temperature=1.0,
                                                  seed=i)))
                for i in range(4)]
            for stream in streams:
                next(stream)
            # Both gateways have polled the engine since: they route by the load it reports.
            for gw in (gateway, second):
                wait_until(lambda gw=gw: _reported_pending_tokens(gw, busy.address) >= 3 * LONG_MAX_TOKENS,
                           what=f"gateway {gw.address} to read the busy engine's load")
            before = _queries(engines)
            requests = [(gw, gateway_pb2.GenerateRequest(prompt=f"fresh {gw.address} {i}", params=_params(4)))
                        for gw in (gateway, second) for i in range(2)]
            with ThreadPoolExecutor(4) as pool:  # at once: each gateway also counts its own two
                list(pool.map(lambda job: job[0].stub.Generate(job[1], timeout=60), requests))
            after = _queries(engines)
            # The test means something only if the engine was still busy throughout.
            assert busy.load().num_running == 4, "the long streams ended too early: the test proves nothing"
            for stream in streams:
                stream.cancel()
        assert after[0] == before[0], "a gateway sent work to the engine that reported itself busy"
        assert after[1] >= before[1] + 4
    finally:
        assert second.stop() == 0


def _wait_idle(engines: list[Engine]) -> None:
    wait_until(lambda: all(e.load().num_running == 0 and e.num_used_blocks() == 0 for e in engines),
               what="every request aborted and its blocks freed")


def test_client_cancel_aborts_the_request_and_frees_its_blocks(gateway: Gateway, engines: list[Engine]) -> None:
    stream = gateway.stub.GenerateStream(_long("cancel me please"), timeout=60)
    next(stream)
    # The engine publishes its load after each step, just after it sent the step's tokens.
    wait_until(lambda: sum(e.load().num_running for e in engines) == 1, what="the stream running")
    assert sum(e.num_used_blocks() for e in engines) > 0
    stream.cancel()
    _wait_idle(engines)


def test_deadline_is_honoured_and_aborts_the_request(gateway: Gateway, engines: list[Engine]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        gateway.stub.Generate(_long("a deadline"), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(engines)  # the gateway passed the deadline on: the engine aborted the request


def test_bad_requests_are_invalid_argument_naming_the_field(gateway: Gateway) -> None:
    _bad, wizard = gateway_pb2.SamplingParams, gateway_pb2.ChatMessage(role="wizard", content="hi")
    cases = {
        "prompt, messages": gateway_pb2.GenerateRequest(),
        "params.temperature": gateway_pb2.GenerateRequest(prompt="x", params=_bad(temperature=-1)),
        "params.n": gateway_pb2.GenerateRequest(prompt="x", params=_bad(n=10_000)),
        "params.max_tokens": gateway_pb2.GenerateRequest(prompt="x", params=_bad(max_tokens=100_000)),
        "messages[0].role": gateway_pb2.GenerateRequest(messages=[wizard]),
        "params.stop_token_ids[0]": gateway_pb2.GenerateRequest(prompt="x", params=_bad(stop_token_ids=[10**6])),
    }
    for field_name, request in cases.items():
        for call in (gateway.stub.Generate, lambda r, **kw: list(gateway.stub.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field_name
            assert field_name in info.value.details()


def test_tokenize_and_list_models(gateway: Gateway, service_model) -> None:
    reply = gateway.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="héllo"), timeout=10)
    assert list(reply.token_ids) == service_model.tokenizer.encode("héllo", add_special_tokens=True)
    [model] = gateway.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
    assert model.vocab_size == service_model.vocab_size and model.block_size == 16 and model.has_chat_template
    assert model.num_backends == 2


def test_metrics_and_access_log(gateway: Gateway) -> None:
    secret = "a prompt that must never be logged"
    gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt=secret, params=_params(4), request_id="logged-1"),
                          timeout=60)
    text = _metrics(gateway)
    assert 'pagedserve_gateway_requests_total{method="Generate",status="OK"}' in text
    assert 'pagedserve_gateway_requests_total{method="Generate",status="INVALID_ARGUMENT"}' in text
    assert "pagedserve_gateway_time_to_first_token_seconds_count" in text
    assert "pagedserve_gateway_time_per_output_token_seconds_count" in text
    assert "pagedserve_gateway_queue_length 0.0" in text
    assert text.count("pagedserve_gateway_backend_healthy{") == 2
    assert text.count("pagedserve_gateway_backend_pending_tokens{") == 2
    log = gateway.log_file.read_text()
    assert secret not in log
    lines = [json.loads(line) for line in log.splitlines() if '"logged-1"' in line]
    assert lines and lines[0]["status"] == "OK" and lines[0]["completion_tokens"] == 4 and lines[0]["ttft_s"] > 0


def test_killing_a_backend_mid_stream_is_unavailable_then_others_serve_then_it_rejoins(
        gateway: Gateway, engines: list[Engine]) -> None:
    stream = gateway.stub.GenerateStream(_long("die mid-stream"), timeout=60)
    next(stream)
    wait_until(lambda: sum(e.load().num_running for e in engines) == 1, what="the stream running")
    [victim] = [e for e in engines if e.load().num_running == 1]
    victim.compute.kill()
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # New requests (sent at once, before any health poll noticed) all succeed on the survivor.
    for i in range(4):
        request = gateway_pb2.GenerateRequest(prompt=f"after the crash {i}", params=_params(4))
        reply = gateway.stub.Generate(request, timeout=30)
        assert reply.choices[0].finish_reason in ("length", "eos", "stop")
    assert gateway.num_healthy_backends() == 1
    victim.restart_compute()
    wait_until(lambda: gateway.num_healthy_backends() == 2, timeout_s=10, what="the restarted backend back in rotation")
