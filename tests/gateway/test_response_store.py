"""The Responses API's stored responses (issue 42): per tenant, bounded by count and bytes, the
oldest evicted first, expiring after the TTL; and the input items' conversion to chat messages."""

from __future__ import annotations

import pytest

from gateway.openai_api.errors import HttpError, ParamError
from gateway.openai_api.response_store import ResponseStore, StoreLimits
from gateway.openai_api.responses_convert import input_messages, renamed
from gateway.openai_api.responses_schema import ResponsesRequest


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _body(i: int, pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "pad": "x" * pad}


def test_count_bound_evicts_the_oldest_and_tenants_are_apart() -> None:
    store = ResponseStore(StoreLimits(max_responses=2, max_bytes=1 << 20, ttl_s=60), Clock())
    for i in range(3):
        assert store.put("a", _body(i), [{"role": "user", "content": str(i)}])
    store.put("b", _body(9), [])
    assert store.get("a", "resp_0") is None and store.get("a", "resp_1").body == _body(1)
    assert store.get("a", "resp_2").context == [{"role": "user", "content": "2"}]
    assert store.get("b", "resp_1") is None and store.num_stored("b") == 1  # another tenant's id: not found
    assert store.delete("a", "resp_1") and not store.delete("a", "resp_1") and store.num_stored("a") == 1


def test_byte_bound_and_ttl() -> None:
    clock = Clock()
    store = ResponseStore(StoreLimits(max_responses=100, max_bytes=1000, ttl_s=60), clock)
    assert not store.put("a", _body(0, pad=2000), [])  # alone beyond the budget: not stored
    for i in range(3):
        store.put("a", _body(i, pad=400), [])
    assert [store.get("a", f"resp_{i}") is not None for i in range(3)] == [False, True, True]
    clock.now += 30
    store.put("a", _body(3), [])
    clock.now += 31  # the first two are past their TTL, the last is not
    assert [store.get("a", f"resp_{i}") is not None for i in range(4)] == [False, False, False, True]
    with pytest.raises(ValueError, match="positive"):
        StoreLimits(ttl_s=0)


def test_input_items_become_chat_turns() -> None:
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                          {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]})
    calls = [{"id": c, "type": "function", "function": {"name": n, "arguments": a}}
             for c, n, a in (("c1", "f", "{}"), ("c2", "g", "{\"x\": 1}"))]
    assert input_messages(body.input) == [
        {"role": "developer", "content": "rules"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me see", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    with pytest.raises(ParamError, match=r"input\[0\].role"):
        input_messages(ResponsesRequest.model_validate({"input": [{"role": "tool", "content": "x"}]}).input)


def test_errors_name_the_responses_parameters() -> None:
    error = renamed(HttpError(400, "max_tokens must be at least 1, got 0", "max_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens must be at least 1, got 0")
    error = renamed(HttpError(400, "messages[3].content: bad", "messages"))
    assert error.param == "input" and error.message.startswith("input (turn 3 of the conversation")
    assert error.message.endswith(".content: bad")
    assert renamed(HttpError(400, "top_p must be > 0", "top_p")).param == "top_p"
    assert renamed(HttpError(400, "response_format: invalid schema", "response_format")).param == "text.format"
