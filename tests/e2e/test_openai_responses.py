"""OpenAI's Responses API on the HTTP front, driven by the official ``openai`` SDK:
``responses.create``, ``responses.stream``, a tool round trip with ``function_call_output`` (whole
input and ``previous_response_id``), structured ``text.format``, stored responses, and refusals.

The module's gateway (``http``) is in front of one of the session's engines with its tiny random
model; the chat endpoint of the same gateway is the reference (same prompt, same tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.conftest import Engine, Http, start_http

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
NAMED = {"type": "function", "name": "get_weather"}
EXACT = {"ignore_eos": True}  # the random model runs to max_output_tokens: counts are exact


def test_create_is_the_chat_answer_in_the_responses_shape(http: Http) -> None:
    client = http.client()
    reply = client.responses.create(model=http.model, input="Hello there", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0, metadata={"run": "e2e"}, extra_body=EXACT)
    chat = client.chat.completions.create(model=http.model, max_tokens=6, temperature=0, extra_body=EXACT,
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hello there"}])
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == http.model
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == chat.choices[0].message.content
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert reply.usage.output_tokens == 6 and reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + 6
    assert reply.metadata == {"run": "e2e"} and reply.instructions == "Be brief."
    again = client.responses.create(model=http.model, input="Hello there", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0, extra_body=EXACT)
    assert again.usage.input_tokens_details.cached_tokens > 0 and again.output_text == reply.output_text


def test_stream_sends_the_event_sequence_the_sdk_assembles(http: Http) -> None:
    client = http.client()
    kwargs = dict(model=http.model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                  max_output_tokens=8, temperature=0, extra_body=EXACT)
    unary = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        kinds, deltas, numbers = [], [], []
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert numbers == list(range(len(numbers)))
    assert "".join(deltas) == final.output_text == unary.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored once complete


def test_a_tool_round_trip_with_the_whole_input_and_with_previous_response_id(http: Http) -> None:
    client = http.client()
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(model=http.model, input=question, tools=[TOOL], tool_choice=NAMED,
                                    temperature=1.0, max_output_tokens=100)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    whole = client.responses.create(model=http.model, input=[*question, *[i.model_dump() for i in first.output],
                                                             result],
                                    tools=[TOOL], max_output_tokens=4, temperature=0, store=False, extra_body=EXACT)
    chained = client.responses.create(model=http.model, previous_response_id=first.id, input=[result],
                                      tools=[TOOL], max_output_tokens=4, temperature=0, extra_body=EXACT)
    # The stored conversation is the very prompt the whole input makes.
    assert chained.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == whole.output_text and chained.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)  # store: false


def test_a_streamed_required_call_arrives_as_function_call_events(http: Http) -> None:
    client = http.client()
    with client.responses.stream(model=http.model, input="Weather?", tools=[TOOL], tool_choice="required",
                                 parallel_tool_calls=False, temperature=1.0, max_output_tokens=100) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    [call] = final.output
    assert call.type == "function_call" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_forced_call_cut_short_is_an_incomplete_function_call(http: Http) -> None:
    reply = http.client().responses.create(model=http.model, input="Weather?", tools=[TOOL], tool_choice=NAMED,
                                           max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [call] = reply.output
    assert call.type == "function_call" and call.status == "incomplete" and call.arguments.startswith("{")


def test_a_stored_call_cut_short_does_not_break_its_continuation(http: Http) -> None:
    client = http.client()
    for stream in (False, True):
        kwargs = dict(model=http.model, input="Weather?", tools=[TOOL], tool_choice=NAMED, max_output_tokens=3,
                      temperature=0)
        if stream:
            with client.responses.stream(**kwargs) as events:
                cut = events.get_final_response()
        else:
            cut = client.responses.create(**kwargs)
        [call] = cut.output
        assert cut.status == "incomplete" and call.status == "incomplete" and cut.store
        # The stored turn holds no unfinished call (its arguments are not JSON): both ways the SDK
        # continues, a call's output and a new message, are answered.
        answer = client.responses.create(model=http.model, previous_response_id=cut.id, tools=[TOOL],
                                         max_output_tokens=2, input=[{"type": "function_call_output",
                                                                      "call_id": call.call_id, "output": "sunny"}])
        again = client.responses.create(model=http.model, previous_response_id=cut.id, input="try again",
                                        max_output_tokens=2)
        assert answer.previous_response_id == again.previous_response_id == cut.id


def test_vllm_extensions_apply_and_a_forced_call_wins_over_text_format(http: Http) -> None:
    client = http.client()
    kwargs = dict(model=http.model, input="x", temperature=1.0, max_output_tokens=6,
                  extra_body={"seed": 11, "ignore_eos": True, "top_k": 5})
    first, second = client.responses.create(**kwargs), client.responses.create(**kwargs)
    assert first.output_text == second.output_text and first.usage.output_tokens == 6
    assert "top_k" not in http.gateway.log_file.read_text()  # read, not logged as unknown
    # The Agents SDK sends both when an agent with an output type forces a tool: the call is the answer.
    reply = client.responses.create(model=http.model, input="Weather?", tools=[TOOL], tool_choice=NAMED,
                                    text={"format": {"type": "json_object"}}, max_output_tokens=100, temperature=0)
    assert [item.type for item in reply.output] == ["function_call"] and reply.status == "completed"


@pytest.mark.parametrize("text_format", [
    {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True},
    {"type": "json_object"},
])
def test_structured_text_format_holds_at_temperature_1(http: Http, service_model: ServiceModel,
                                                      text_format: dict) -> None:
    reply = http.client().responses.create(model=http.model, input="JSON please", text={"format": text_format},
                                           temperature=1.0, max_output_tokens=80, extra_body={"seed": 3})
    assert reply.status == "completed", reply.output_text
    # The e2e model's EOS is an ordinary byte token, whose text ends an answer the grammar ended.
    value = json.loads(reply.output_text.removesuffix(service_model.tokenizer.decode([service_model.eos_token_id])))
    if text_format["type"] == "json_schema":
        jsonschema.validate(value, WEATHER)
    assert reply.text.format.type == text_format["type"]


def test_stored_responses_are_read_deleted_and_named_when_missing(http: Http) -> None:
    client = http.client()
    reply = client.responses.create(model=http.model, input="keep me", max_output_tokens=2)
    assert client.responses.retrieve(reply.id).model_dump() == reply.model_dump()
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(reply.id)
    assert info.value.body["code"] is None and reply.id in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=http.model, input="x", previous_response_id=reply.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("kwargs,param,words", [
    ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", "file_search"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format", ""),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": 5}, "input", ""),
    ({"metadata": {"k": "v" * 600}}, "metadata", "512"),
    ({"metadata": {"k": 1}}, "metadata.k", ""),
    ({"input": []}, "input", "required"),
    ({"input": [{}]}, "input", "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"tools": [{"type": "function"}]}, "tools", "name"),
    ({"tools": [TOOL], "tool_choice": "bogus"}, "tool_choice", "bogus"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", "other"),
    ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format", ""),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "xml"),
    ({"previous_response_id": 5}, "previous_response_id", ""),
    ({"background": True}, "background", "background"),
    ({"stream": "maybe"}, "stream", ""),
    ({"truncation": "auto"}, "truncation", "auto"),
    ({"max_tool_calls": 1}, "max_tool_calls", "max_tool_calls"),
    ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "template"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "low"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(http: Http, kwargs: dict, param: str, words: str) -> None:
    body = {"model": http.model, "input": "x", "max_output_tokens": 4, **kwargs}
    reply = httpx.post(f"{http.base_url}/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error", error


def test_raw_events_are_named_and_the_access_lines_say_responses(http: Http) -> None:
    body = {"model": http.model, "input": "x", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{http.base_url}/v1/responses", json=body, timeout=30,
                      headers={"x-request-id": "rid-responses-stream"}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and names[0] == "response.created" and names[-1] == "response.completed"
    response_id = datas[-1]["response"]["id"]
    assert response_id.startswith("resp_")  # the client's request id names the request, not the response
    whole = httpx.post(f"{http.base_url}/v1/responses", json={**body, "stream": False}, timeout=30,
                       headers={"x-request-id": "rid-responses-whole"})
    assert whole.status_code == 200
    assert httpx.get(f"{http.base_url}/v1/responses/{response_id}", timeout=10).status_code == 200
    assert httpx.delete(f"{http.base_url}/v1/responses/{response_id}", timeout=10).status_code == 200
    assert httpx.get(f"{http.base_url}/v1/responses/{response_id}", timeout=10).status_code == 404
    lines = [json.loads(line) for line in http.gateway.log_file.read_text().splitlines() if line.startswith("{")]
    access = {(line.get("method"), line.get("status")) for line in lines if line.get("event") == "request"}
    assert {("OpenAI.Responses.Retrieve", "OK"), ("OpenAI.Responses.Delete", "OK"),
            ("OpenAI.Responses.Retrieve", "NOT_FOUND")} <= access
    ids = {line.get("request_id") for line in lines if line.get("method") == "OpenAI.Responses"}
    assert {"rid-responses-stream", "rid-responses-whole"} <= ids


def test_a_response_too_large_to_store_says_store_false(engines: list[Engine], run_dir: Path) -> None:
    small = start_http(engines, run_dir, "--responses-store-max-bytes", "200")
    try:
        client = small.client()
        for stream in (False, True):
            if stream:
                with client.responses.stream(model=small.model, input="x", max_output_tokens=2) as events:
                    reply = events.get_final_response()
            else:
                reply = client.responses.create(model=small.model, input="x", max_output_tokens=2)
            assert reply.store is False, stream  # said now, not as a later 404
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(reply.id)
            assert f'"response_id": "{reply.id}"' in small.gateway.log_file.read_text()
    finally:
        assert small.gateway.stop() == 0


def test_tenants_have_their_own_bounded_stores_keys_and_priority_caps(engines: list[Engine], run_dir: Path) -> None:
    keys = run_dir / "responses-keys.txt"
    keys.write_text("responses-key-a-0123456789\nresponses-key-b-0123456789\n")
    keyed = start_http(engines, run_dir, "--api-keys-file", str(keys), "--responses-store-max-responses", "2",
                       key="responses-key-a-0123456789")
    try:
        a, b = keyed.client("responses-key-a-0123456789"), keyed.client("responses-key-b-0123456789")
        theirs = b.responses.create(model=keyed.model, input="theirs", max_output_tokens=2)
        mine = [a.responses.create(model=keyed.model, input="mine", max_output_tokens=2) for _ in range(3)]
        assert a.responses.retrieve(mine[2].id).id == mine[2].id
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(mine[0].id)  # the oldest of a's, past its bound of 2
        assert b.responses.retrieve(theirs.id).id == theirs.id  # a's traffic evicts none of b's
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(mine[2].id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=keyed.model, input="x", previous_response_id=mine[2].id, max_output_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").responses.create(model=keyed.model, input="x", max_output_tokens=2)
        with pytest.raises(openai.PermissionDeniedError):  # above the tenant's priority cap (0)
            a.responses.create(model=keyed.model, input="x", max_output_tokens=2, extra_body={"priority": 3})
        with pytest.raises(openai.PermissionDeniedError):
            a.embeddings.create(model=keyed.model, input="x", extra_body={"priority": 3})
    finally:
        assert keyed.gateway.stop() == 0
