"""Prompt logprobs end to end: OpenAI's ``echo`` with ``logprobs`` on
/v1/completions (the shape lm-evaluation-harness's loglikelihood reads, ``max_tokens: 0`` included),
vLLM's ``prompt_logprobs`` on both endpoints and the gRPC ``params.prompt_logprobs``, each equal to
transformers' float32 log-softmax of the tiny random model's logits. Such a request reads nothing
from the prefix cache."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from pagedserve.gateway.v1 import gateway_pb2
from tests.e2e.conftest import Http

TOL = 1e-4


def prompt_ids(http: Http, prompt: str) -> list[int]:
    return list(http.gateway.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=prompt), timeout=10).token_ids)


def hf_logprobs(service_model, ids: list[int]) -> torch.Tensor:
    """(L - 1, V): transformers' float32 log-softmax at positions 0..L-2."""
    with torch.no_grad():
        logits = service_model.hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def test_echo_with_logprobs_equals_transformers(http: Http, service_model) -> None:
    prompt = "Score this prompt, please."
    ids = prompt_ids(http, prompt)
    want = hf_logprobs(service_model, ids)
    reply = http.client().completions.create(model=http.model, prompt=prompt, max_tokens=3, temperature=0,
                                             logprobs=2, echo=True, extra_body={"ignore_eos": True})
    [choice] = reply.choices
    lp = choice.logprobs
    decode = service_model.tokenizer.decode
    generated = choice.text[len(prompt):]
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 3
    assert lp.tokens[:len(ids)] == [decode([t]) for t in ids] and "".join(lp.tokens[len(ids):]) == generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        row = want[i - 1]
        assert lp.token_logprobs[i] == pytest.approx(float(row[ids[i]]), abs=TOL)
        values, top = row.topk(2)
        assert lp.top_logprobs[i] == pytest.approx({decode([t]): v for t, v in zip(top.tolist(), values.tolist())},
                                                   abs=TOL)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert reply.usage.completion_tokens == 3 and reply.usage.prompt_tokens == len(ids)


def test_score_only_max_tokens_0(http: Http, service_model) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt's scores, nothing generated."""
    ids = prompt_ids(http, "context and continuation")
    want = hf_logprobs(service_model, ids)
    reply = http.client().completions.create(model=http.model, prompt=[ids], max_tokens=0, temperature=0,
                                             logprobs=1, echo=True)
    [choice] = reply.choices
    assert choice.text == "context and continuation" and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and reply.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([float(want[i - 1, ids[i]])
                                                               for i in range(1, len(ids))], abs=TOL)
    # echo without logprobs: the text alone
    plain = http.client().completions.create(model=http.model, prompt="just echo", max_tokens=0, echo=True)
    assert plain.choices[0].text == "just echo" and plain.choices[0].logprobs is None


def test_echo_streamed_reassembles_to_the_whole_answer(http: Http) -> None:
    kwargs = dict(model=http.model, prompt="stream the echo", max_tokens=5, temperature=0, logprobs=1, echo=True,
                  extra_body={"ignore_eos": True})
    whole = http.client().completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in http.client().completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.logprobs.tokens for c in chunks if c.logprobs), []) == whole.logprobs.tokens
    assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == whole.logprobs.token_logprobs


def test_vllm_prompt_logprobs_on_both_endpoints_and_grpc(http: Http, service_model) -> None:
    prompt = "vLLM's prompt logprobs"
    ids = prompt_ids(http, prompt)
    want = hf_logprobs(service_model, ids)

    def check(entries: list) -> None:
        assert entries[0] is None and len(entries) == len(ids)
        for i in range(1, len(ids)):
            entry, row = entries[i], want[i - 1]
            mine = entry[str(ids[i])]
            assert mine["logprob"] == pytest.approx(float(row[ids[i]]), abs=TOL)
            assert mine["rank"] == int((row > row[ids[i]]).sum()) + 1
            assert mine["decoded_token"] == service_model.tokenizer.decode([ids[i]])
            top = int(row.argmax())
            assert entry[str(top)]["logprob"] == pytest.approx(float(row[top]), abs=TOL)

    reply = http.client().completions.create(model=http.model, prompt=prompt, max_tokens=2,
                                             extra_body={"prompt_logprobs": 1})
    check(reply.choices[0].prompt_logprobs)
    assert reply.choices[0].logprobs is None and not reply.choices[0].text.startswith(prompt)
    chat = [{"role": "user", "content": "score me"}]
    chat_ids = service_model.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    chat_reply = http.client().chat.completions.create(model=http.model, messages=chat, max_tokens=2,
                                                       extra_body={"prompt_logprobs": 0})
    chat_want = hf_logprobs(service_model, chat_ids)
    assert [e and next(iter(e.values()))["logprob"] for e in chat_reply.prompt_logprobs][1:] == pytest.approx(
        [float(chat_want[i - 1, chat_ids[i]]) for i in range(1, len(chat_ids))], abs=TOL)

    grpc = http.gateway.stub.Generate(gateway_pb2.GenerateRequest(
        prompt=prompt, params=gateway_pb2.SamplingParams(max_tokens=2, prompt_logprobs=1)), timeout=60)
    assert [lp.token_id for lp in grpc.prompt_logprobs] == ids[1:]
    assert [lp.logprob for lp in grpc.prompt_logprobs] == pytest.approx(
        [float(want[i - 1, ids[i]]) for i in range(1, len(ids))], abs=TOL)
    assert [list(lp.top_token_ids) for lp in grpc.prompt_logprobs] == want.topk(1).indices.tolist()
    stream = list(http.gateway.stub.GenerateStream(gateway_pb2.GenerateRequest(
        prompt=prompt, params=gateway_pb2.SamplingParams(max_tokens=2, prompt_logprobs=1)), timeout=60))
    assert stream[0].prompt_logprobs == grpc.prompt_logprobs and not any(m.prompt_logprobs for m in stream[1:])


def test_a_scoring_request_reads_no_cached_prefix(http: Http) -> None:
    prompt = "a prompt long enough to fill whole blocks of sixteen tokens, twice over at least"
    client = http.client()
    client.completions.create(model=http.model, prompt=prompt, max_tokens=1)  # now cached
    for _ in range(2):
        reply = client.completions.create(model=http.model, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert len(reply.choices[0].logprobs.token_logprobs) == reply.usage.prompt_tokens
        assert all(v is not None for v in reply.choices[0].logprobs.token_logprobs[1:])
    plain = client.completions.create(model=http.model, prompt=prompt, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0  # the others still share it


def test_bad_values_are_400_naming_the_parameter(http: Http) -> None:
    client = http.client()
    for kwargs, param in [({"logprobs": 21, "echo": True}, "logprobs"),
                          ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
                          ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
                          ({"extra_body": {"prompt_logprobs": 1}, "stream": True}, "prompt_logprobs"),
                          ({"max_tokens": 0}, "max_tokens"),
                          ({"max_tokens": 0, "echo": True, "n": 2}, "n")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=http.model, prompt="x", **{"max_tokens": 2, **kwargs})
        assert info.value.status_code == 400 and info.value.body["param"] == param, (kwargs, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=http.model, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"prompt_logprobs": 30})
    assert info.value.body["param"] == "prompt_logprobs"
    import grpc
    with pytest.raises(grpc.RpcError) as error:
        http.gateway.stub.Generate(gateway_pb2.GenerateRequest(
            prompt="x", params=gateway_pb2.SamplingParams(prompt_logprobs=21)), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.prompt_logprobs" in error.value.details()


def test_lm_evaluation_harness_loglikelihood_request(http: Http, service_model) -> None:
    """What lm-evaluation-harness's local-completions sends for a loglikelihood (its payload as its
    source writes it) and how it reads the answer: the continuation's summed logprobs, and whether
    each continuation token was the most likely one. Its remote tokenizer finds /tokenizer_info."""
    info = httpx.get(f"{http.base_url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "</s>" and info["chat_template"] and info["model_max_length"] == 1024
    context, continuation = prompt_ids(http, "The answer is"), prompt_ids(http, " forty-two")
    ids = context + continuation
    body = {"model": http.model, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    [choice] = httpx.post(f"{http.base_url}/v1/completions", json=body, timeout=60).json()["choices"]
    ctxlen = len(context)
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))
    want = hf_logprobs(service_model, ids)
    rows = want[ctxlen - 1:]
    assert sum(token_logprobs) == pytest.approx(float(sum(rows[i, t] for i, t in enumerate(continuation))), abs=1e-3)
    assert is_greedy == all(int(rows[i].argmax()) == t for i, t in enumerate(continuation))
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 1
