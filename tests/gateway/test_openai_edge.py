"""The HTTP front's conversions without processes: OpenAI bodies to public requests, errors to
statuses, logprobs to OpenAI's shapes (-inf clamped), SSE framing."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.backend.compute_convert import model_info_from_pb
from gateway.core.types import Completion, Delta, Reply, TokenLogprobs, Usage
from gateway.core.validate import validate
from gateway.openai_api import convert
from gateway.openai_api.app import as_http_error, error_body
from gateway.openai_api.responses import Answer, events, sse
from gateway.openai_api.schema import ChatCompletionRequest, CompletionRequest
from pagedserve.errors import (DeadlineExceededError, InvalidArgument, PermissionDeniedError, ResourceExhaustedError,
                               UnavailableError)
from pagedserve.compute.v1 import compute_pb2

INFO = model_info_from_pb(compute_pb2.InfoResponse(model_name="m", max_model_len=64, vocab_size=100))


def _chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_statuses_of_every_error_type() -> None:
    bad = as_http_error(InvalidArgument("params.top_p must be in (0.0, 1.0], got 1.5"))
    assert (bad.status, bad.param, bad.message) == (400, "top_p", "top_p must be in (0.0, 1.0], got 1.5")
    assert as_http_error(InvalidArgument("messages[2].role must be one of ...")).param == "messages"
    assert as_http_error(convert.ParamError("logit_bias", "no")).param == "logit_bias"
    for exc, status in ((ResourceExhaustedError("full"), 429), (UnavailableError("down"), 503),
                        (PermissionDeniedError("no"), 403), (DeadlineExceededError("late"), 504),
                        (RuntimeError("a bug"), 500), (ValueError("a bare one is a bug too"), 500)):
        assert as_http_error(exc).status == status, exc
    assert error_body(429, "full") == {"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                                 "code": "rate_limit_exceeded"}}
    assert error_body(503, "down")["error"]["type"] == "server_error"


def test_minus_infinity_logprobs_are_clamped() -> None:
    items = [TokenLogprobs(token_id=1, logprob=float("-inf"), top_token_ids=[2, 1], top_logprobs=[-0.5, float("-inf")])]
    decode = {1: "a", 2: "bc"}.__getitem__
    chat = convert.chat_logprobs(items, decode)
    assert chat == {"content": [{"token": "a", "logprob": -9999.0, "bytes": [97], "top_logprobs": [
        {"token": "bc", "logprob": -0.5, "bytes": [98, 99]}, {"token": "a", "logprob": -9999.0, "bytes": [97]}]}]}
    json.dumps(chat, allow_nan=False)  # valid JSON: no Infinity
    done = convert.completion_logprobs(items * 2, decode, offset=5)
    assert done["token_logprobs"] == [-9999.0, -9999.0] and done["text_offset"] == [5, 6]
    assert done["top_logprobs"][0] == {"bc": -0.5, "a": -9999.0}


def test_completion_prompts_and_parameters() -> None:
    body = CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 2, "stop": "x", "seed": 3, "top_k": -1,
                                             "logprobs": 0, "max_tokens": 5, "cache_salt": "s", "priority": 2})
    [first, second] = convert.completion_prompts(body, "cmpl-1")
    assert (first.request.prompt, second.request.prompt) == ("a", "b") and first.request.prompt_token_ids is None
    assert (first.request.request_id, second.request.request_id) == ("cmpl-1-0", "cmpl-1-1")
    p = first.request.options
    assert (p.n, list(p.stop), p.seed, p.top_k, p.logprobs, p.max_tokens) == (2, ["x"], 3, 0, 0, 5)
    assert p.temperature is None
    assert (first.request.cache_salt, first.request.priority) == ("s", 2)
    [ids] = convert.completion_prompts(CompletionRequest.model_validate({"prompt": [5, 6]}), "c")
    assert ids.request.prompt_token_ids == [5, 6] and ids.request.options.max_tokens is None
    assert validate(ids.request, INFO).params["max_tokens"] == 16  # completions' default
    assert len(convert.completion_prompts(CompletionRequest.model_validate({"prompt": [[5], [6, 7]]}), "c")) == 2
    for fields, param in (({"prompt": []}, "prompt"), ({"prompt": "a", "n": 0}, "n"),
                          ({"prompt": "a", "max_tokens": 0}, "max_tokens"), ({"prompt": "a", "top_p": 0}, "top_p"),
                          ({"prompt": "a", "seed": -1}, "seed"),
                          ({"prompt": "a", "echo": True, "max_tokens": 0, "n": 2}, "n"),
                          ({"prompt": "a", "echo": True, "logprobs": 21}, "logprobs"),
                          ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
                          ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                          ({"prompt": "a", "logit_bias": {"1": 200}}, "logit_bias"),
                          ({"prompt": "a", "logit_bias": {"x": 2}}, "logit_bias"),
                          ({"prompt": "a", "logit_bias": {"1000": 2}}, "logit_bias"),
                          ({"prompt": "a", "n": 2**40}, "n"), ({"prompt": "a", "top_k": 2**40}, "top_k"),
                          ({"prompt": "a", "priority": 2**40}, "priority"), ({"prompt": [5, 100]}, "prompt")):
        # Shapes fail converting; every bound is the core's validate, its message naming the gRPC
        # field, which the HTTP answer maps to the parameter.
        with pytest.raises(InvalidArgument) as info:
            for prompt in convert.completion_prompts(CompletionRequest.model_validate(fields), "c"):
                validate(prompt.request, INFO)
        error = as_http_error(info.value)
        assert (error.status, error.param) == (400, param), (fields, str(info.value))


def test_echo_and_prompt_logprobs_shapes() -> None:
    """echo with logprobs: the prompt's tokens lead the choice's logprobs (the first with null), the
    prompt's text leads its text; vLLM's prompt_logprobs: null, then {token id: logprob, rank, text}."""
    body = CompletionRequest.model_validate({"prompt": [1, 2, 3], "echo": True, "logprobs": 1, "max_tokens": 0})
    [prompt] = convert.completion_prompts(body, "c")
    assert (prompt.request.options.prompt_logprobs, prompt.request.options.max_tokens) == (1, 0)
    assert validate(prompt.request, INFO).params["max_tokens"] == 0  # score only
    plain = convert.completion_prompts(CompletionRequest.model_validate({"prompt": "a", "echo": True}), "c")
    assert plain[0].request.options.prompt_logprobs is None  # echo alone scores nothing
    decode = {1: "a", 2: "bc", 3: "d", 4: "e"}.__getitem__
    scored = [TokenLogprobs(2, -1.0, [4], [-0.5], rank=2), TokenLogprobs(3, -0.25, [3], [-0.25], rank=1)]
    answer = Answer("c", "m", "completions", n=1, logprobs=True, decode=decode, echo=[[1, 2, 3]],
                    decode_text=lambda ids: "".join(map(decode, ids)), num_top=1, prompt_logprobs=True)
    reply = Reply("c", [Completion(0, "e", [4], [TokenLogprobs(4, -2.0, [4], [-2.0])], "length")], Usage(3, 1),
                  scored, [1, 2, 3])
    [choice] = answer.body([reply])["choices"]
    assert choice["text"] == "abcde"
    assert choice["logprobs"] == {"tokens": ["a", "bc", "d", "e"], "token_logprobs": [None, -1.0, -0.25, -2.0],
                                  "top_logprobs": [None, {"e": -0.5}, {"d": -0.25}, {"e": -2.0}],
                                  "text_offset": [0, 1, 3, 4]}
    assert choice["prompt_logprobs"] == [None, {"2": {"logprob": -1.0, "rank": 2, "decoded_token": "bc"},
                                                "4": {"logprob": -0.5, "rank": 1, "decoded_token": "e"}},
                                         {"3": {"logprob": -0.25, "rank": 1, "decoded_token": "d"}}]


def test_chat_prompt_conversion() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_tokens": 4, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "tool_choice": "none"})
    request = convert.chat_prompt(body, "chatcmpl-1").request
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"), ("user", "ab")]
    assert request.options.max_tokens == 7 and request.options.logprobs == 3  # max_completion_tokens wins
    assert convert.chat_prompt(_chat(), "c").request.options.logprobs is None
    for fields, param in (({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
                          ({"tool_choice": "sometimes"}, "tool_choice"),
                          ({"tool_choice": {"type": "function"}}, "tool_choice"),
                          ({"functions": [{"name": "f"}]}, "functions"),
                          ({"top_logprobs": 2}, "top_logprobs"),
                          ({"response_format": {"type": "yaml"}}, "response_format"),
                          ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                           "messages[0].content")):
        with pytest.raises(convert.ParamError) as info:
            convert.chat_prompt(_chat(**fields), "c")
        assert info.value.param == param, fields


def test_structured_output_spellings_reach_the_constraint_oneof() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fields, kind, value, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}},
         "json_schema", schema, "response_format"),
        ({"response_format": {"type": "json_object"}}, "json_object", True, "response_format"),
        ({"structured_outputs": {"json": schema}}, "json_schema", schema, "structured_outputs.json"),
        ({"structured_outputs": {"json": json.dumps(schema)}}, "json_schema", schema, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a+", "json_object": False}}, "regex", "a+", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"], "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "grammar", 'root ::= "a"',
         "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object", True, "structured_outputs.json_object"),
        ({"guided_json": schema}, "json_schema", schema, "guided_json"),
        ({"guided_regex": "b"}, "regex", "b", "guided_regex"),
        ({"guided_choice": ["z"]}, "choice", ["z"], "guided_choice"),
        ({"guided_grammar": "root ::= \"b\""}, "grammar", 'root ::= "b"', "guided_grammar"),
    ]:
        for prompt in (convert.chat_prompt(_chat(**fields), "c"),
                       convert.completion_prompts(CompletionRequest.model_validate({"prompt": "p", **fields}), "c")[0]):
            constraint = prompt.request.options.constraint
            assert constraint.kind == kind and prompt.constraint_param == param, fields
            if kind == "json_schema":
                got = json.loads(constraint.spec)
            elif kind == "choice":
                got = list(constraint.choices)
            elif kind == "json_object":
                got = True
            else:
                got = constraint.spec
            assert got == value, fields
    for fields in ({}, {"response_format": {"type": "text"}}, {"structured_outputs": {"json_object": False}}):
        prompt = convert.chat_prompt(_chat(**fields), "c")
        assert prompt.request.options.constraint is None and prompt.constraint_param is None
    for fields, param in [({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
                          ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
                           "response_format"),
                          ({"structured_outputs": {"regex": "x" * 5000}}, "structured_outputs.regex"),
                          ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
                          ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
                          ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs")]:
        with pytest.raises(convert.ParamError) as info:
            convert.chat_prompt(_chat(**fields), "c")
        assert info.value.param == param, (fields, str(info.value))
    # The compute service's verdict names the gRPC field; the answer names the HTTP parameter.
    verdict = InvalidArgument("params.json_schema: invalid JSON schema: unknown type 'no'")
    error = as_http_error(verdict, "response_format")
    assert (error.status, error.param) == (400, "response_format")
    assert error.message == "response_format: json_schema: invalid JSON schema: unknown type 'no'"
    assert as_http_error(InvalidArgument("params.top_p must be > 0"), "response_format").param == "top_p"


def test_stream_events_shape() -> None:
    answer = Answer("chatcmpl-x", "m", "chat", n=1, logprobs=False, decode=str, include_usage=True)
    pieces = [Delta(index=0, text="he"),
              Delta(index=0, text="llo", finish_reason="eos",
                    usage=Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=0))]

    async def rest():
        yield 0, pieces[1]

    async def collect() -> list[str]:
        return [e async for e in events(answer, (0, pieces[0]), rest(), lambda exc: {})]

    out = asyncio.run(collect())
    assert out[-1] == sse("[DONE]") == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in out[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [{"role": "assistant", "content": ""},
                                                               {"content": "he"}, {"content": "llo"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_stalled_sse_send_ends_the_stream_and_frees_its_requests() -> None:
    """In process: a send that never completes (the client's socket buffers full)
    ends the stream after the stall timeout: the stall is told once, the events' generator is
    closed (which aborts the requests) and the response's slots released."""
    from gateway.openai_api.transport import EventStream

    closed, stalls, released, sent = [], [], [], []

    async def body():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def run() -> None:
        never = asyncio.Event()

        async def send(message: dict) -> None:
            sent.append(message)
            if len(sent) == 3:  # the client reads nothing from here on
                await never.wait()

        async def receive() -> dict:
            await never.wait()  # connected all along: no http.disconnect
            return {}

        stream = EventStream(body(), 0.05, on_stall=lambda: stalls.append(1), on_close=lambda: released.append(1))
        await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(run())
    assert (len(sent), stalls, released, closed) == (3, [1], [1], [True])
    assert sent[0]["type"] == "http.response.start"
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n"]
