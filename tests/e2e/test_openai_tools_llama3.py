"""Llama 3.x JSON tool calls through the HTTP front: a gateway whose chat template (its
``--chat-template-file``) is Llama-3 style, so ``auto`` picks the llama3_json parser and the template
renders tools and earlier calls itself.

The random model writes no call of its own accord, so the answer is held to a Llama-3 call by a
``response_format`` JSON schema (allowed with ``tool_choice: auto``): what the parser must then read
is exactly what a Llama model writes, ``{"name": ..., "parameters": {...}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from pagedserve.process import wait_until
from tests.e2e.conftest import Engine, Http, start_http

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
# What a Llama 3 model writes for a call of get_weather.
LLAMA_CALL = {"type": "json_schema", "json_schema": {"name": "call", "schema": {
    "type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
    "required": ["name", "parameters"], "additionalProperties": False}}}
# Llama 3.1's template in small (each byte is a token of the e2e model, whose context is 1024).
TEMPLATE = """{%- if tools %}<|start_header_id|>system<|end_header_id|>
Respond with {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t.function.name }}{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}
{%- if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>
<|python_tag|>{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>
{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>
{{ m.content }}<|eot_id|>
{%- endif %}{%- endfor %}<|start_header_id|>assistant<|end_header_id|>
"""


@pytest.fixture(scope="module")
def llama3(engines: list[Engine], run_dir: Path) -> Iterator[Http]:
    template = run_dir / "llama3-template.jinja"
    template.write_text(TEMPLATE)
    started = start_http(engines, run_dir, "--chat-template-file", str(template))
    wait_until(lambda: started.gateway.num_healthy_backends() == 1, what="the backend in rotation")
    yield started
    assert started.gateway.stop() == 0


def _reassemble(stream) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_reads_llama3_calls_whole_and_streamed(llama3: Http) -> None:
    client = llama3.client()
    kwargs = dict(model=llama3.model, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=80,
                  response_format=LLAMA_CALL)
    [unary] = client.chat.completions.create(**kwargs).choices
    assert unary.finish_reason == "tool_calls" and unary.message.content is None
    [call] = unary.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, finish = _reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert calls == [(call.function.name, call.function.arguments)]
    # Cut short: the unfinished call is the content, with its own finish reason.
    [cut] = client.chat.completions.create(**{**kwargs, "max_tokens": 12}).choices
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content.startswith('{"name"')


def test_the_template_renders_tools_and_earlier_calls(llama3: Http) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tokens = httpx.post(f"{llama3.base_url}/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    text = httpx.post(f"{llama3.base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}<|eom_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\nsunny" in text
    reply = llama3.client().chat.completions.create(model=llama3.model, messages=history, tools=TOOLS, max_tokens=4,
                                                    temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens > len(tokens)  # the tools' system turn comes in with tools
