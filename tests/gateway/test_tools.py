"""Tool calling in the gateway core, in process: the checks, the generic
rendering into a plain template, the grammar of required and named choices, and the parser over
streamed deltas (the Hermes format; unfinished or unparseable calls stay content)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import jsonschema
import pytest

from gateway.backend.compute_convert import model_info_from_pb
from gateway.backend.tokenizer import ModelTokenizer
from gateway.core import tools
from gateway.core.streaming import collect, pieces
from gateway.core.types import ChatMessage, Delta, GenerateRequest, Tool, ToolCall
from gateway.core.validate import validate
from pagedserve import json_text
from pagedserve.compute.v1 import compute_pb2
from pagedserve.errors import InvalidArgument
from pagedserve_testing.tiny_model import build_byte_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [Tool("get_weather", "Weather by city", json.dumps(WEATHER)), Tool("now", "The time")]
CHAT = [ChatMessage("user", "Weather in Oslo?")]
pytestmark = pytest.mark.unit  # in process, no model file
INFO = model_info_from_pb(compute_pb2.InfoResponse(model_name="m", max_model_len=512, vocab_size=258))


def _request(**fields: object) -> GenerateRequest:
    return GenerateRequest(**{"messages": list(CHAT), "tools": list(TOOLS), **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("fields,message", [
    ({"tools": [Tool("a b")]}, r"^tools\[0\]\.name must be"),
    ({"tools": [Tool("f"), Tool("f")]}, r"^tools\[1\]\.name: 'f' is given twice"),
    ({"tools": [Tool("f", parameters="{nope")]}, r"^tools\[0\]\.parameters: not valid JSON"),
    ({"tools": [Tool("f", parameters='{"type": "object", "properties": {"x": {"type": 5}}}')]},
     r"^tools\[0\]\.parameters: invalid JSON schema"),
    ({"tools": [Tool("f", parameters='{"type": "string"}')]},
     r"^tools\[0\]\.parameters must be a JSON schema of an object"),
    ({"tool_choice": "function", "tool_function": "other"}, r"^tool_choice: function 'other' is not one of the tools"),
    ({"tool_choice": "sometimes"}, r"^tool_choice must be one of"),
    ({"tools": None, "tool_choice": "required"}, r"^tool_choice 'required' needs tools"),
    ({"messages": [ChatMessage("user", "x", (ToolCall("c", "f", "{}"),))]},
     r"^messages\[0\]\.tool_calls: only an assistant"),
    ({"messages": [ChatMessage("assistant", "", (ToolCall("c", "f", "[1]"),))]},
     r"^messages\[0\]\.tool_calls\[0\]\.arguments must be the JSON text of an object"),
    # Nested 100,000 levels, Python's decoder raised RecursionError, a 500.
    ({"messages": [ChatMessage("assistant", "", (ToolCall("c", "f", '{"a":' * 100_000 + "1" + "}" * 100_000),))]},
     r"^messages\[0\]\.tool_calls\[0\]\.arguments must be the JSON text of an object"),
    ({"tools": [Tool("f", parameters='{"a":' * 100_000 + "1" + "}" * 100_000)]},
     r"^tools\[0\]\.parameters: nested too deeply"),
    ({"tools": [Tool(f"f{i}") for i in range(129)]}, r"^tools: at most 128 tools"),
])
def test_bad_tools_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        tools.plan(_request(**fields))


def test_required_and_named_choices_are_json_schemas_the_engine_compiles() -> None:
    named = tools.plan(_request(tool_choice="function", tool_function="get_weather"))
    assert json.loads(named.constraint().spec) == WEATHER
    required = tools.plan(_request(tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(required.constraint().spec)
    assert schema["minItems"] == schema["maxItems"] == 1
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}], schema)
    jsonschema.validate([{"name": "now", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    assert tools.plan(_request()).constraint() is None  # auto
    assert tools.plan(_request(tool_choice="none")) is None
    # The constraint goes through the core's validate like any other.
    request = tools.constrained(_request(tool_choice="required"), required)
    assert validate(request, INFO).request.options.constraint.kind == "json_schema"
    with pytest.raises(InvalidArgument, match="^tool_choice 'required' constrains the output itself"):
        tools.plan(request)


def test_the_generic_rendering_writes_tools_calls_and_results_into_a_plain_template() -> None:
    model = ModelTokenizer(build_byte_tokenizer(), INFO)
    assert not model.renders_tools
    history = [ChatMessage("system", "Be brief."), *CHAT,
               ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Oslo", "days": 1}'),)),
               ChatMessage("tool", "sunny", tool_call_id="call_1")]
    messages, specs = tools.template_messages(_request(messages=history), native=False)
    assert specs is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in system
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}'
                                      '\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    text = model.hf_tokenizer.decode(model.encode_chat(messages))
    assert "<tools>" in text and "<tool_response>" in text
    # No system turn: one is added; tool_choice none leaves the tools out.
    assert tools.template_messages(_request(), native=False)[0][0]["role"] == "system"
    assert tools.template_messages(_request(tool_choice="none"), native=False)[0] == [{"role": "user",
                                                                                     "content": CHAT[0].content}]
    native, specs = tools.template_messages(_request(messages=history), native=True)
    assert specs[0]["function"]["parameters"] == WEATHER
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "days": 1}
    assert native[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


async def _deltas(texts: list[str], finish: str, index: int = 0) -> AsyncIterator[Delta]:
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        yield Delta(index, text, [i], finish_reason=finish if last else "")


def _run(plan: tools.ToolPlan, texts: list[str], finish: str = "stop") -> tuple:
    async def go() -> tuple:
        unary = await collect("r", tools.with_tool_calls(_deltas(texts, finish), plan, lambda t: "<eos>"))
        streamed = [p async for p in pieces(tools.with_tool_calls(_deltas(texts, finish), plan, lambda t: "<eos>"))]
        return unary.choices[0], streamed
    return asyncio.run(go())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_auto_parses_hermes_calls_from_any_split_of_the_stream(split: int) -> None:
    plan = tools.plan(_request())
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Oslo", "Bergen")
    choice, streamed = _run(plan, [text[i:i + split] for i in range(0, len(text), split)])
    assert choice.finish_reason == "tool_calls" and choice.text == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in choice.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Bergen", "days": 2})]
    assert "".join(p.text for p in streamed) == choice.text  # no part of a call streamed as content
    assert [(c.name, c.arguments) for p in streamed for c in p.tool_calls] == \
        [(c.name, c.arguments) for c in choice.tool_calls]
    assert all(c.id.startswith("call_") for c in choice.tool_calls)


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ",  # unfinished
    "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>",  # no such tool
    "<tool_call>not json</tool_call>",
    CALL + " and then some words",
    "a plain answer with < and <tool_ but no call",
])
def test_auto_leaves_unparseable_calls_as_content(text: str) -> None:
    choice, streamed = _run(tools.plan(_request()), [text[i:i + 4] for i in range(0, len(text), 4)], "length")
    assert (choice.text, choice.finish_reason, choice.tool_calls) == (text, "length", [])
    assert "".join(p.text for p in streamed) == text


def test_required_and_named_outputs_become_calls_without_the_eos_text() -> None:
    named = tools.plan(_request(tool_choice="function", tool_function="get_weather"))
    choice, _ = _run(named, ['{"city":', '"Oslo","days":3}<eos>'], "eos")
    assert choice.finish_reason == "tool_calls" and choice.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in choice.tool_calls] == [("get_weather",
                                                                              {"city": "Oslo", "days": 3})]
    required = tools.plan(_request(tool_choice="required"))
    choice, _ = _run(required, ['[{"name":"now","arguments":{}},', '{"name":"now","arguments":{}}]'])
    assert [c.name for c in choice.tool_calls] == ["now", "now"] and choice.finish_reason == "tool_calls"
    assert len({c.id for c in choice.tool_calls}) == 2
    choice, _ = _run(named, ['{"city":"Os'], "length")  # cut short: the partial call, finish_reason "length"
    [call] = choice.tool_calls
    assert (choice.text, choice.finish_reason, call.name, call.arguments) == ("", "length", "get_weather",
                                                                              '{"city":"Os')


def test_a_sampled_lone_surrogate_escape_becomes_arguments_that_are_text() -> None:
    """A sampled call may spell a lone surrogate ("\\ud83d" is valid JSON): its arguments write it as
    its \\u escape, the same JSON value, text a protobuf string and an HTTP body carry (a sampled
    call written back as it was decoded answered 500). A pair stays one character, written as it is."""
    named = tools.plan(_request(tool_choice="function", tool_function="get_weather"))
    choice, _ = _run(named, ['{"city":"\\ud83dO\\u00e9","days":1}'], "eos")
    [call] = choice.tool_calls
    assert call.arguments == '{"city": "\\ud83dO\u00e9", "days": 1}'
    assert json.loads(call.arguments) == {"city": "\ud83dO\u00e9", "days": 1}
    compute_pb2.InfoResponse(model_name=call.arguments).SerializeToString()  # a protobuf string takes it
    choice, _ = _run(named, ['{"city":"\\ud83d\\ude00\\u00e9","days":1}'], "eos")
    assert choice.tool_calls[0].arguments == '{"city": "\U0001f600\u00e9", "days": 1}'
    # Sent back in the next turn, the call (and a tool's schema spelling one) reach the prompt with the
    # surrogate replaced by U+FFFD, both ways a prompt renders tools.
    weird = Tool("odd", "Odd", '{"type": "object", "description": "\\udc00"}')
    turn = _request(tools=[*TOOLS, weird], messages=[*CHAT, ChatMessage("assistant", "", (call,)),
                                                     ChatMessage("tool", "sunny", tool_call_id=call.id)])
    messages, rendered_tools = tools.template_messages(turn, native=True)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "\ufffdO\u00e9", "days": 1}
    assert rendered_tools[-1]["function"]["parameters"]["description"] == "\ufffd"
    messages, _ = tools.template_messages(turn, native=False)
    assert all(json_text.is_text(m["content"]) for m in messages) and "\ufffdO\u00e9" in messages[2]["content"]


@pytest.mark.parametrize("text,want", [
    ('[{"name":"now","arguments":{}}, {"name": "get_weather", "arguments": {"city":"Os',
     [("now", "{}"), ("get_weather", '{"city":"Os')]),
    ('[{"name":"now","arguments":{}}', [("now", "{}")]),
    ('[{"name":"get_wea', []),
    ('[', []),
    (' ', []),
])
def test_a_required_output_cut_short_is_its_calls_so_far(text: str, want: list) -> None:
    choice, _ = _run(tools.plan(_request(tool_choice="required")), [text], "length")
    assert choice.finish_reason == "length" and choice.text == ""
    assert [(c.name, c.arguments) for c in choice.tool_calls] == want
    assert all(c.id.startswith("call_") for c in choice.tool_calls)


# --- Llama 3.x JSON calls, and choosing the parser -------------------------------------------------

LLAMA = tools.PARSERS["llama3_json"]
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'


def _llama_plan(**fields: object) -> tools.ToolPlan:
    return tools.plan(_request(**fields), LLAMA)


@pytest.mark.parametrize("text,want", [
    (LLAMA_CALL, [("get_weather", {"city": "Oslo", "days": 2})]),
    ("  <|python_tag|>" + LLAMA_CALL + "\n", [("get_weather", {"city": "Oslo", "days": 2})]),
    (LLAMA_CALL + '; {"name": "now", "parameters": {}};<|python_tag|>{"name": "now", "arguments": {}}',
     [("get_weather", {"city": "Oslo", "days": 2}), ("now", {}), ("now", {})]),
])
@pytest.mark.parametrize("split", [1, 5, 1000])
def test_llama3_json_calls_from_any_split_of_the_stream(text: str, want: list, split: int) -> None:
    choice, streamed = _run(_llama_plan(), [text[i:i + split] for i in range(0, len(text), split)])
    assert choice.finish_reason == "tool_calls" and choice.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in choice.tool_calls] == want
    assert "".join(p.text for p in streamed) == ""  # nothing of a call streamed as content
    assert [c.arguments for p in streamed for c in p.tool_calls] == [c.arguments for c in choice.tool_calls]


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": ',  # unfinished
    '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}',  # unclosed
    '{"name": get_weather}',  # not JSON
    '{"name": "nope", "parameters": {}}',  # no such tool
    LLAMA_CALL + " and some words",
    LLAMA_CALL + '; {"name": "now"',  # the second call unfinished
    '["not", "a call"]',
    "<|python_tag|>print('hi')",
])
def test_llama3_json_unparseable_calls_are_content(text: str) -> None:
    choice, streamed = _run(_llama_plan(), [text[i:i + 3] for i in range(0, len(text), 3)], "length")
    assert (choice.text, choice.finish_reason, choice.tool_calls) == (text, "length", [])
    assert "".join(p.text for p in streamed) == text


def test_llama3_json_content_streams_at_once_and_holds_no_call() -> None:
    """A call only begins the answer: text that starts otherwise streams as it comes, calls or not."""
    text = "Sure: " + LLAMA_CALL
    choice, streamed = _run(_llama_plan(), [text[i:i + 2] for i in range(0, len(text), 2)])
    assert (choice.text, choice.tool_calls, choice.finish_reason) == (text, [], "stop")
    assert streamed[0].text == "Su"  # not held back
    held = _run(_llama_plan(), ["  <|pyth", "on_tag|>" + LLAMA_CALL])[1]
    assert held[0].text == "" and held[-1].tool_calls  # whitespace and a tag's start wait
    parallel = _llama_plan(parallel_tool_calls=False)
    choice, _ = _run(parallel, [LLAMA_CALL + "; " + LLAMA_CALL])
    assert len(choice.tool_calls) == 1


def test_the_parser_is_chosen_from_the_template_or_the_flag() -> None:
    llama3 = ('{{- bos_token }}{%- if tools %}Respond in the format {"name": function name, "parameters": '
              'dictionary of argument name and its value}.{% endif %}<|python_tag|>')
    hermes = "{% if tools %}<tools>{{ tools }}</tools> reply with <tool_call>...</tool_call>{% endif %}"
    from gateway.core.tool_parsers import choose

    assert choose("auto", llama3).name == "llama3_json"
    assert choose("auto", hermes).name == "hermes"
    assert choose("auto", "{% for m in messages %}{{ m.content }}{% endfor %}").name == "hermes"  # generic
    assert choose("auto", "").name == "hermes"
    assert choose("llama3_json", hermes).name == "llama3_json" and choose("hermes", llama3).name == "hermes"


def test_the_generic_rendering_asks_for_the_parsers_format() -> None:
    history = [*CHAT, ChatMessage("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Oslo", "days": 1}'),
                                                    ToolCall("c2", "now", "{}"))),
               ChatMessage("tool", "sunny", tool_call_id="c1")]
    messages, _ = tools.template_messages(_request(messages=history), native=False, parser=LLAMA)
    assert messages[0]["content"].endswith('{"name": "<function name>", "parameters": <arguments object>}')
    assert "<tool_call>" not in messages[0]["content"]
    assert messages[2]["content"] == ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
                                      '{"name": "now", "parameters": {}}')
    # What it asks for is what it parses.
    assert LLAMA.parse(messages[2]["content"], tools.plan(_request()).tools) is not None


def test_gateway_flag_names_the_parsers() -> None:
    from gateway.config import GatewayConfig

    assert GatewayConfig(backends=("unix:x",), tool_call_parser="llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes, llama3_json"):
        GatewayConfig(backends=("unix:x",), tool_call_parser="mistral")


def test_tools_count_against_the_prompt_size_before_anything_is_parsed() -> None:
    """128 tools of 220 properties (3.8 MB) passed the messages' character cap and took
    21.9 s to render and tokenize before their 400. Now the tools' text counts, against the model's
    context too (16 characters a token at most), and the 400 comes before any schema is parsed."""
    import time

    from gateway.core.validate import MAX_CHARS_PER_TOKEN, PromptLimits, check_prompt_size

    schema = json.dumps({"type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 80}
                                                          for j in range(220)}})
    request = _request(tools=[Tool(f"f{i}", "A tool", schema) for i in range(128)])
    started = time.perf_counter()
    with pytest.raises(InvalidArgument, match=rf"^messages, tools: at most {512 * MAX_CHARS_PER_TOKEN} characters in "
                                              r"all for this model \(its context is 512 tokens; tools count\)"):
        check_prompt_size(request, INFO, PromptLimits())
    assert time.perf_counter() - started < 0.05
    check_prompt_size(_request(), INFO, PromptLimits())  # the usual request passes
    with pytest.raises(InvalidArgument, match=r"^prompt: at most 100 characters"):
        check_prompt_size(GenerateRequest(prompt="x" * 101), INFO, PromptLimits(max_prompt_chars=100))
