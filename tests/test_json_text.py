"""JSON text written back from decoded values stays UTF-8 (pagedserve/json_text.py), also the
normalized JSON schema the compute service keys its grammar cache by and hands to xgrammar."""

from __future__ import annotations

import json

import pytest

from pagedserve import json_text
from pagedserve.compute.v1 import compute_pb2
from pagedserve.grammar_limits import normalized_json_schema

pytestmark = pytest.mark.unit


def test_other_scripts_stay_as_they_are_and_a_lone_surrogate_is_escaped() -> None:
    assert json_text.dumps({"city": "Zürich 東京 😀"}) == '{"city": "Zürich 東京 😀"}'
    lone = json.loads('{"city": "\\ud83dZ\\u00fcrich"}')
    text = json_text.dumps(lone)
    assert text == '{"city": "\\ud83dZürich"}' and json.loads(text) == lone and json_text.is_text(text)
    assert not json_text.is_text(json.dumps(lone, ensure_ascii=False))


def test_loads_replaces_a_lone_surrogate_and_keeps_a_pair() -> None:
    text = '{"\\udc00k": ["\\ud83d", "\\ud83d\\ude00", 1, {"a": "\\ud800x"}], "b": "plain ü"}'
    assert json_text.loads(text) == {"\ufffdk": ["\ufffd", "😀", 1, {"a": "\ufffdx"}], "b": "plain ü"}
    assert json_text.loads('{"a": "ü\\u00fc"}') == {"a": "üü"}


def test_a_schema_with_a_lone_surrogate_normalizes_to_text_a_protobuf_carries() -> None:
    spec = '{"type": "string", "enum": ["\\udc00", "ü"], "description": "dropped"}'
    normalized = normalized_json_schema(spec)
    assert json.loads(normalized) == {"type": "string", "enum": ["\udc00", "ü"]}
    compute_pb2.InfoResponse(model_name=normalized).SerializeToString()
