"""Tool calling through both fronts, with the real ``openai`` SDK and gRPC.

The e2e model's template is a plain one without a tools branch, so the tools go into the prompt
by the generic rendering and ``auto`` uses the Hermes parser; ``required`` and a named function
are held to the tools' schemas by the structured-output grammar, so at temperature 1.0 every call
parses and validates (jsonschema) whatever the random model prefers.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from pagedserve.gateway.v1 import gateway_pb2
from tests.e2e.conftest import Http

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
UNITS = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
# Few and small: every prompt byte is a token of the e2e model, whose context is 1024 tokens.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_unit", "parameters": UNITS}},
         {"type": "function", "function": {"name": "now"}}]
SCHEMAS = {"get_weather": WEATHER, "set_unit": UNITS, "now": {"type": "object", "additionalProperties": False}}
MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _check_calls(calls: list, parallel: bool = True) -> None:
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("tool_choice,parallel", [(NAMED, True), ("required", False)])
def test_named_and_required_calls_parse_and_validate_at_temperature_1(http: Http, tool_choice: object,
                                                                      parallel: bool) -> None:
    client = http.client()
    for seed in range(2):
        reply = client.chat.completions.create(model=http.model, messages=MESSAGES, tools=TOOLS,
                                               tool_choice=tool_choice, parallel_tool_calls=parallel,
                                               temperature=1.0, seed=seed, n=3, max_tokens=100)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and choice.message.role == "assistant"
            _check_calls(choice.message.tool_calls, parallel)
            if tool_choice is NAMED:
                assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def _reassemble(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_call_deltas_reassemble_to_the_unary_answer(http: Http) -> None:
    client = http.client()
    kwargs = dict(model=http.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
                  seed=11, max_tokens=100, parallel_tool_calls=False)
    [unary] = client.chat.completions.create(**kwargs).choices
    content, calls, finish = _reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert finish == unary.finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in unary.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)


def test_a_two_turn_exchange_with_a_tool_result_on_both_fronts(http: Http) -> None:
    client = http.client()
    first = client.chat.completions.create(model=http.model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=100)
    [call] = first.choices[0].message.tool_calls
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "temp_c": 4}'}]
    second = client.chat.completions.create(model=http.model, messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=8, extra_body={"ignore_eos": True})
    # auto: the random model writes no call, so its text is the content.
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments)

    # The same exchange on gRPC: the same prompt, the same tokens.
    tools = [gateway_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                              parameters=json.dumps(t["function"]["parameters"]) if "parameters" in t["function"]
                              else "") for t in TOOLS]
    messages = [gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    params = gateway_pb2.SamplingParams(max_tokens=100, temperature=0)
    reply = http.gateway.stub.Generate(gateway_pb2.GenerateRequest(
        messages=messages, tools=tools, tool_choice=gateway_pb2.ToolChoice(function_name="get_weather"),
        params=params), timeout=60)
    [grpc_call] = reply.choices[0].tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert (grpc_call.name, grpc_call.arguments) == (call.function.name, call.function.arguments)
    messages += [gateway_pb2.ChatMessage(role="assistant", tool_calls=[grpc_call]),
                 gateway_pb2.ChatMessage(role="tool", tool_call_id=grpc_call.id, content=history[-1]["content"])]
    params = gateway_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reply = http.gateway.stub.Generate(gateway_pb2.GenerateRequest(messages=messages, tools=tools, params=params),
                                       timeout=60)
    assert reply.choices[0].text == second.choices[0].message.content
    assert reply.usage.prompt_tokens == second.usage.prompt_tokens


def test_auto_without_a_call_is_plain_content_and_none_leaves_tools_out(http: Http) -> None:
    client = http.client()
    kwargs = dict(model=http.model, messages=MESSAGES, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    auto = client.chat.completions.create(**kwargs, tools=TOOLS)
    plain = client.chat.completions.create(**kwargs)
    none = client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="none")
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens == none.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("kwargs,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                               {"x": {"type": 5}}}}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400_naming_the_parameter(http: Http, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        http.client().chat.completions.create(model=http.model, messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_bad_tools_are_invalid_argument_on_grpc(http: Http) -> None:
    messages = [gateway_pb2.ChatMessage(role="user", content="hi")]
    for fields, message in (({"tools": [gateway_pb2.Tool(name="f"), gateway_pb2.Tool(name="f")]},
                             "tools[1].name: 'f' is given twice"),
                            ({"tools": [gateway_pb2.Tool(name="f", parameters="{")]}, "tools[0].parameters: not valid"),
                            ({"tools": [gateway_pb2.Tool(name="f")],
                              "tool_choice": gateway_pb2.ToolChoice(function_name="g")}, "tool_choice: function")):
        with pytest.raises(grpc.RpcError) as info:
            http.gateway.stub.Generate(gateway_pb2.GenerateRequest(messages=messages, **fields), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(message)


def test_a_forced_call_cut_short_is_finish_reason_length_with_the_partial_call(http: Http) -> None:
    """vLLM's answer: the call the client forced, its arguments' text so far, and
    finish_reason "length" as for any answer cut short; whole and streamed alike."""
    client = http.client()
    kwargs = dict(model=http.model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=3)
    [cut] = client.chat.completions.create(**kwargs).choices
    assert cut.finish_reason == "length" and cut.message.content is None
    [call] = cut.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    content, calls, finish = _reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
