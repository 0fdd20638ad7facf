"""The Responses API's stored responses: per tenant, bounded by count and bytes, the
oldest evicted first, expiring after the TTL (swept for every tenant), a total bound whose excess the
heaviest tenant pays, keyed by the tenant's namespace; and the input items' conversion to chat
messages."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.core.types import ToolCall
from gateway.openai_api.errors import HttpError, ParamError
from gateway.openai_api.response_store import ResponseStore, StoreLimits, stored_bytes
from gateway.openai_api.responses_api import ResponsesEndpoint
from gateway.openai_api.responses_events import Output
from gateway.tenants import Tenant
from gateway.openai_api.responses_convert import input_messages, renamed
from gateway.openai_api.responses_schema import ResponsesRequest


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _body(i: int, pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "pad": "x" * pad}


def _put(store: ResponseStore, tenant: str, body: dict, context: list[dict]) -> bool:
    return store.put(tenant, body, context, stored_bytes(body, context))


def test_count_bound_evicts_the_oldest_and_tenants_are_apart() -> None:
    store = ResponseStore(StoreLimits(max_responses=2, max_bytes=1 << 20, ttl_s=60), Clock())
    for i in range(3):
        assert _put(store, "a", _body(i), [{"role": "user", "content": str(i)}])
    _put(store, "b", _body(9), [])
    assert store.get("a", "resp_0") is None and store.get("a", "resp_1").body == _body(1)
    assert store.get("a", "resp_2").context == [{"role": "user", "content": "2"}]
    assert store.get("b", "resp_1") is None and store.num_stored("b") == 1  # another tenant's id: not found
    assert store.delete("a", "resp_1") and not store.delete("a", "resp_1") and store.num_stored("a") == 1


def test_byte_bound_and_ttl() -> None:
    clock = Clock()
    store = ResponseStore(StoreLimits(max_responses=100, max_bytes=1000, ttl_s=60), clock)
    assert not _put(store, "a", _body(0, pad=2000), [])  # alone beyond the budget: not stored
    for i in range(3):
        _put(store, "a", _body(i, pad=400), [])
    assert [store.get("a", f"resp_{i}") is not None for i in range(3)] == [False, True, True]
    clock.now += 30
    _put(store, "a", _body(3), [])
    clock.now += 31  # the first two are past their TTL, the last is not
    assert [store.get("a", f"resp_{i}") is not None for i in range(4)] == [False, False, False, True]
    with pytest.raises(ValueError, match="positive"):
        StoreLimits(ttl_s=0)


def test_expiry_is_swept_for_every_tenant_on_put() -> None:
    clock = Clock()
    store = ResponseStore(StoreLimits(max_responses=100, max_bytes=1000, ttl_s=60), clock)
    _put(store, "a", _body(0, pad=300), [])
    clock.now += 61
    _put(store, "b", _body(1), [])  # a is never read again: b's put frees its expired bytes
    assert store.num_stored("a") == 0 and store.num_bytes == stored_bytes(_body(1), [])


def test_the_total_bound_takes_the_oldest_of_the_heaviest_tenant() -> None:
    store = ResponseStore(StoreLimits(max_responses=100, max_bytes=1000, ttl_s=60, max_total_bytes=1500))
    size = stored_bytes(_body(0, pad=400), [])
    _put(store, "light", _body(0, pad=400), [])
    for i in (1, 2):
        _put(store, "heavy", _body(i, pad=400), [])
    assert store.num_bytes == 3 * size
    _put(store, "light", _body(3, pad=400), [])  # past 1,500: heavy (two) loses its oldest, light keeps its own
    assert store.get("heavy", "resp_1") is None and store.get("heavy", "resp_2") is not None
    assert store.num_stored("light") == 2 and store.num_bytes == 3 * size
    assert not _put(store, "light", _body(4, pad=1600), [])  # alone past every bound: refused, nothing evicted
    assert store.num_bytes == 3 * size
    with pytest.raises(ValueError, match="positive"):
        StoreLimits(max_total_bytes=0)


def test_responses_are_kept_by_the_tenant_namespace_not_its_name() -> None:
    # A plain key's tenant is named by its list position: a new key in that position (the old one
    # revoked) has the same name, and must not read what the old key stored.
    endpoint = ResponsesEndpoint(SimpleNamespace(core=None), ResponseStore())  # type: ignore[arg-type]
    old, new = Tenant("key-1", keys=("old-key-0123456789",)), Tenant("key-1", keys=("new-key-0123456789",))
    final = {"id": "resp_1", "store": True}
    asyncio.run(endpoint._keep(old, final, [{"role": "user", "content": "x"}], Output("hi")))
    assert endpoint._stored(old, "resp_1").body == final
    with pytest.raises(HttpError) as info:
        endpoint._stored(new, "resp_1")
    assert info.value.status == 404


def test_a_stored_call_cut_short_keeps_only_complete_calls() -> None:
    done, cut = ToolCall("call_1", "f", '{"a": 1}'), ToolCall("call_2", "f", '{"a": ')
    assert Output("", [done, cut], "length").chat_message() == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert Output("", [cut], "length").chat_message() == {"role": "assistant", "content": ""}
    assert len(Output("", [done], "tool_calls").chat_message()["tool_calls"]) == 1


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
