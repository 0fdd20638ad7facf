"""Bad input, limits and early ends over the wire: every bad request gets INVALID_ARGUMENT naming the
field (and the service keeps serving); abort, cancel and an expired deadline give the request's
blocks back to the memory service (its stats prove it)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pagedserve_testing.tiny_model import ServiceModel
from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.process import wait_until
from tests.compute_service.service_fixtures import Services, running_services

# ~1000 engine steps: still running when we act (sampled, so no speculative drafts shorten it)
LONG = dict(max_tokens=1000, temperature=1.0, seed=7, ignore_eos=True)
PROMPT = [40, 97, 109, 32, 97, 32, 116, 105, 110, 121]
NAN = float("nan")


@pytest.fixture(scope="module")
def services(service_model: ServiceModel) -> Iterator[Services]:
    # 300 blocks of 4 = 1200 tokens: a LONG request fits; prompt + max_tokens may never exceed it.
    with running_services(service_model.path, memory_args=("--max-num-blocks", "300"),
                          compute_args=("--max-queued-requests", "3")) as services:
        yield services


def start(services: Services, request_id: str = "", **params) -> grpc.Call:
    """A running stream: its first message has arrived (the request holds blocks)."""
    call = services.stub.Generate(cpb.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                                      params=cpb.SamplingParams(**{**LONG, **params})), timeout=60)
    first = next(call)
    assert len(first.token_ids) == 1
    return call


BAD = [
    ("empty prompt", dict(prompt_token_ids=[]), "prompt_token_ids"),
    ("id above the vocabulary", dict(prompt_token_ids=[1, 258]), "prompt_token_ids"),
    ("negative id", dict(prompt_token_ids=[1, -1]), "prompt_token_ids"),
    ("beyond the model's length", dict(params=cpb.SamplingParams(max_tokens=1020)), "max_tokens"),
    ("negative max_tokens", dict(params=cpb.SamplingParams(max_tokens=-3)), "max_tokens"),
    ("negative temperature", dict(params=cpb.SamplingParams(temperature=-0.5)), "temperature"),
    ("NaN temperature", dict(params=cpb.SamplingParams(temperature=NAN)), "temperature"),
    ("top_p zero", dict(params=cpb.SamplingParams(top_p=0.0)), "top_p"),
    ("top_p above one", dict(params=cpb.SamplingParams(top_p=1.5)), "top_p"),
    ("negative top_k", dict(params=cpb.SamplingParams(top_k=-1)), "top_k"),
    ("min_p above one", dict(params=cpb.SamplingParams(min_p=2.0)), "min_p"),
    ("NaN min_p", dict(params=cpb.SamplingParams(min_p=NAN)), "min_p"),
    ("zero repetition_penalty", dict(params=cpb.SamplingParams(repetition_penalty=0.0)), "repetition_penalty"),
    ("presence_penalty too big", dict(params=cpb.SamplingParams(presence_penalty=3.0)), "presence_penalty"),
    ("NaN frequency_penalty", dict(params=cpb.SamplingParams(frequency_penalty=NAN)), "frequency_penalty"),
    ("negative n", dict(params=cpb.SamplingParams(n=-1)), "n must"),
    ("n above the limit", dict(params=cpb.SamplingParams(n=65)), "n must"),
    ("logprobs above the limit", dict(params=cpb.SamplingParams(logprobs=21)), "logprobs"),
    ("negative logprobs", dict(params=cpb.SamplingParams(logprobs=-1)), "logprobs"),
    ("too many stop strings", dict(params=cpb.SamplingParams(stop=[f"s{i}" for i in range(17)])), "stop"),
    ("empty stop string", dict(params=cpb.SamplingParams(stop=[""])), "stop"),
    ("stop id outside the vocabulary", dict(params=cpb.SamplingParams(stop_token_ids=[300])), "stop_token_ids"),
    ("long cache_salt", dict(cache_salt="s" * 257), "cache_salt"),
    ("long request_id", dict(request_id="r" * 257), "request_id"),
    ("min_tokens above max_tokens", dict(params=cpb.SamplingParams(max_tokens=4, min_tokens=5)), "min_tokens"),
    # Counts are bounded (they were not: two million stop ids stalled the engine), and named as such.
    ("one stop id over the limit", dict(params=cpb.SamplingParams(stop_token_ids=[1] * 1025)),
     "params.stop_token_ids: at most 1024 ids, got 1025"),
    ("stop string over its length", dict(params=cpb.SamplingParams(stop=["x" * 257])), "params.stop[0]"),
    # The length is checked before any id: the out-of-vocabulary ids are never looked at.
    ("prompt over the model's length", dict(prompt_token_ids=[300] * 1025), "prompt_token_ids: at most 1024 tokens"),
    # n completions hold n copies of max_tokens: 2 + 2 x 176 blocks of 4 > 300, though 10 + 700 < 1200.
    ("n copies beyond the pool", dict(params=cpb.SamplingParams(n=2, max_tokens=700)), "params.n"),
]


@pytest.mark.parametrize(("case", "fields", "field_name"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_and_the_next_request_is_served(
    services: Services, case: str, fields: dict, field_name: str
) -> None:
    request = cpb.GenerateRequest(**{"prompt_token_ids": PROMPT, **fields})
    with pytest.raises(grpc.RpcError) as err:
        list(services.stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    assert field_name in err.value.details(), err.value.details()
    assert services.generate(PROMPT, max_tokens=2, temperature=0.0)[-1].usage.completion_tokens == 2


def test_limits_hold_exactly_at_the_limit(services: Services) -> None:
    """Well-behaved requests at each bound are served as before."""
    at_limit = cpb.GenerateRequest(prompt_token_ids=PROMPT, params=cpb.SamplingParams(
        max_tokens=2, temperature=0.0, stop_token_ids=[1] * 1024, stop=["x" * 256]))
    assert sum(len(m.token_ids) for m in services.stub.Generate(at_limit, timeout=60)) <= 2
    # 2 + 2 x 126 = 254 blocks of 300: two completions of 500 tokens fit at once.
    fits = cpb.GenerateRequest(prompt_token_ids=PROMPT, params=cpb.SamplingParams(n=2, max_tokens=500, temperature=0.0))
    call = services.stub.Generate(fits, timeout=60)
    assert len(next(call).token_ids) == 1
    call.cancel()
    services.wait_released()


def test_a_message_beyond_the_wire_limit_is_refused_before_parsing(services: Services) -> None:
    """The receive limit is sized from the request limits (about 2.4 MB), not a flat 64 MiB: a 2.6 MB
    prompt is refused by gRPC itself (RESOURCE_EXHAUSTED), never parsed or walked on the event loop."""
    huge = cpb.GenerateRequest(prompt_token_ids=[200] * 1_300_000)  # 2 bytes per id on the wire
    assert huge.ByteSize() > 2_500_000
    with pytest.raises(grpc.RpcError) as err:
        list(services.stub.Generate(huge, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert services.generate(PROMPT, max_tokens=2, temperature=0.0)[-1].usage.completion_tokens == 2


def test_abort_ends_the_stream_and_frees_the_blocks(services: Services) -> None:
    call = start(services, request_id="to-abort")
    assert services.memory_stats().num_sequences == 1
    assert services.stub.Abort(cpb.AbortRequest(request_id="to-abort")).found
    rest = list(call)
    assert rest[-1].finish_reason == "abort" and rest[-1].usage.prompt_tokens == len(PROMPT)
    assert sum(len(m.token_ids) for m in rest) < 999
    services.wait_released()


def test_client_cancel_frees_the_blocks(services: Services) -> None:
    call = start(services)
    call.cancel()
    services.wait_released()
    # The engine publishes its load right after the freeing step.
    wait_until(lambda: services.stub.Load(cpb.LoadRequest()).num_running == 0, 10, "no request running",
               interval_s=0.01)


def test_expired_deadline_frees_the_blocks(services: Services) -> None:
    call = services.stub.Generate(cpb.GenerateRequest(prompt_token_ids=PROMPT, params=cpb.SamplingParams(**LONG)),
                                  timeout=0.5)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    services.wait_released()


def test_duplicate_running_request_id_is_already_exists(services: Services) -> None:
    call = start(services, request_id="dup")
    with pytest.raises(grpc.RpcError) as err:
        services.generate(PROMPT, request_id="dup", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    services.wait_released()
    # Free again once it ended. Greedy and EOS ignored: a sampled token is an EOS id now and then.
    reply = services.generate(PROMPT, request_id="dup", max_tokens=2, temperature=0.0, ignore_eos=True)
    assert sum(len(m.token_ids) for m in reply) == 2


def test_full_queue_is_resource_exhausted(services: Services) -> None:
    calls = [start(services) for _ in range(3)]  # --max-queued-requests 3
    with pytest.raises(grpc.RpcError) as err:
        services.generate(PROMPT, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    load = services.stub.Load(cpb.LoadRequest())
    assert load.num_running + load.num_waiting == 3 and load.num_pending_tokens > 2900
    assert 0.0 < load.kv_usage < 1.0
    for call in calls:
        call.cancel()
    services.wait_released()
    reply = services.generate(PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True)  # greedy: no EOS by chance
    assert sum(len(m.token_ids) for m in reply) == 2
