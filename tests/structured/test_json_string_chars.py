"""The characters a JSON schema's strings admit (compute_service/structured/compile_worker.py
`json_schema_ebnf`): text only. xgrammar's own rules let through raw control characters in a
length-bounded string and UTF-8-encoded surrogates in every string; a sampled tool call once spelled
one (bytes ED A0 80), which decodes to three U+FFFD and broke its schema's maxLength."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from xgrammar import testing

from compute_service.structured.compile_worker import json_schema_ebnf

SCHEMA = ('{"type": "object", "properties": {"free": {"type": "string"}, "short": {"type": "string", "maxLength": 6}},'
          ' "required": ["free", "short"], "additionalProperties": false}')


def _accepts(free: bytes, short: bytes) -> bool:
    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(SCHEMA, strict_mode=True))
    return testing._is_grammar_accept_string(grammar, b'{"free": "' + free + b'", "short": "' + short + b'"}')


@pytest.mark.parametrize(("free", "short"), [(b"x", "+flJ\u20ac`".encode()),
                                             ("\U0001F600".encode(), "\u00e9t\u00e9".encode()),
                                             (b"a\\u00e9", b"abcdef")])
def test_text_is_admitted_and_bounded_by_characters(free: bytes, short: bytes) -> None:
    assert _accepts(free, short)


@pytest.mark.parametrize(("free", "short"), [(b"x", b"+flJ\xed\xa0\x80`"), (b"\xed\xb0\x80", b"x"), (b"\x01", b"x"),
                                             (b"x", b"\x1f"), (b"x", b"abcdefg")])
def test_surrogates_control_characters_and_overlong_values_are_not(free: bytes, short: bytes) -> None:
    assert not _accepts(free, short)
