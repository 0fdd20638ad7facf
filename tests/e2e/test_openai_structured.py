"""Structured outputs through the OpenAI-compatible HTTP front, with the official ``openai`` SDK.

OpenAI's ``response_format`` (json_schema, json_object) and vLLM's ``structured_outputs`` and
``guided_*`` extensions reach the same constraint as the gRPC API; bad ones are 400s naming the
parameter, whether the gateway refuses them (shape, sizes, two at once) or the compute service
(an invalid schema, compiled there). The e2e model's EOS is an ordinary byte token: a completion
that ends on it has that byte's text last, so the text is checked without it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.conftest import Http

SCHEMA = {"type": "object", "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}
MESSAGES = [{"role": "user", "content": "Give me a record as JSON."}]


def _text(service_model: ServiceModel, text: str, finish_reason: str) -> str:
    """The completion's text without a final EOS byte's text (its other EOS, the tokenizer's
    special ``</s>``, has none): "stop" is where the grammar ended."""
    if finish_reason == "stop":
        return text.removesuffix(service_model.tokenizer.decode([service_model.eos_token_id]))
    return text


def test_chat_response_format_json_schema_validates(http: Http, service_model: ServiceModel) -> None:
    client = http.client()
    reply = client.chat.completions.create(
        model=http.model, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=5, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}})
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(_text(service_model, choice.message.content, "stop")), SCHEMA)
    assert any(c.finish_reason == "stop" for c in reply.choices), [c.message.content for c in reply.choices]
    stream = client.chat.completions.create(model=http.model, messages=MESSAGES, max_tokens=40, temperature=0,
                                            response_format={"type": "json_object"}, stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(_text(service_model, text, "stop")), dict), text


def test_completions_structured_outputs_choice_and_regex(http: Http, service_model: ServiceModel) -> None:
    client = http.client()
    choices = ["red", "green", "blue"]
    reply = client.completions.create(model=http.model, prompt="Colour: ", max_tokens=8, temperature=1.0, seed=2,
                                      n=4, extra_body={"structured_outputs": {"choice": choices}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and _text(service_model, choice.text, "stop") in choices, choice
    for extra in ({"structured_outputs": {"regex": r"\d{3}-[a-z]{2}"}}, {"guided_regex": r"\d{3}-[a-z]{2}"}):
        [choice] = client.completions.create(model=http.model, prompt="Code: ", max_tokens=12, temperature=0,
                                             extra_body=extra).choices
        assert choice.finish_reason == "stop"
        assert re.fullmatch(r"\d{3}-[a-z]{2}", _text(service_model, choice.text, "stop")), (extra, choice.text)


def test_bad_constraints_are_400_naming_the_parameter(http: Http) -> None:
    client = http.client()
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    for create, kwargs, param, message in [
        # The compute service compiles: its INVALID_ARGUMENT comes back naming the HTTP parameter.
        (client.chat.completions.create, {"response_format": bad_schema}, "response_format", "json_schema"),
        (client.completions.create, {"extra_body": {"structured_outputs": {"regex": "(ab"}}},
         "structured_outputs.regex", "Regex parsing error"),
        # The gateway checks shapes, sizes and that one constraint is given.
        (client.chat.completions.create, {"response_format": {"type": "json_object"},
                                          "extra_body": {"guided_regex": "a+"}}, "guided_regex", "at most one"),
        (client.completions.create, {"extra_body": {"structured_outputs": {"choice": []}}},
         "structured_outputs.choice", "must hold 1 to 256 strings"),
        (client.completions.create, {"extra_body": {"guided_grammar": "x" * 40000}}, "guided_grammar",
         "at most 32768 characters"),
        (client.chat.completions.create, {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        (client.completions.create, {"extra_body": {"structured_outputs": {"structural_tag": "t"}}},
         "structured_outputs", "structural_tag not supported"),
    ]:
        target = {"messages": MESSAGES} if create == client.chat.completions.create else {"prompt": "x"}
        with pytest.raises(openai.BadRequestError) as info:
            create(model=http.model, max_tokens=4, **target, **kwargs)
        body = info.value.body
        assert info.value.status_code == 400 and body["param"] == param and message in body["message"], body
    # Free text (response_format text) still works after every refusal (ignore_eos: an unseeded
    # sample of the e2e model may draw its EOS byte within 3 tokens).
    reply = client.chat.completions.create(model=http.model, messages=MESSAGES, max_tokens=3,
                                           response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
