"""The characters a JSON schema's strings admit (compute_service/structured/compile_worker.py
`json_schema_ebnf`): text only. xgrammar's own rules let through raw control characters in a
length-bounded string and UTF-8-encoded surrogates in every string; a sampled tool call once spelled
one (bytes ED A0 80), which decodes to three U+FFFD and broke its schema's maxLength."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar import testing

from compute_service.structured.compile_worker import compile_constraint, json_schema_ebnf, text_only_regex

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


# A regular expression's `.`, negated classes, \S \D \W and ranges across U+D800-DFFF admitted the
# surrogates' encodings too, in a `regex` constraint and in a schema's `pattern` (`text_only_regex`).

@pytest.mark.parametrize(("regex", "rewritten"), [
    (r"^a.$", r"^a[^\uD800-\uDFFF]$"),
    (r"[^a]\.[.]", r"[^\uD800-\uDFFFa]\.[.]"),
    (r"\S\s\D\d\W\w", r"[^\s\uD800-\uDFFF]\s[^\d\uD800-\uDFFF]\d[^\w\uD800-\uDFFF]\w"),
    (r"[\u0000-\uffff]+", r"[\u0000-\uD7FF\uE000-\uffff]+"),
    (r"[\uDC00-\uFFFF][\x00-\uD900][a\uD800-\uDFFF]", r"[\uE000-\uFFFF][\x00-\uD7FF][a]"),
    (r"[a-z\S]{2}", r"([a-z]|[^\s\uD800-\uDFFF]){2}"),
    (r"[\uD800-\uDFFF\S]", r"[^\s\uD800-\uDFFF]"),
    (r"[^]", r"[^\uD800-\uDFFF]"),
    (r"[^a-][^\w-][^-a]", r"[^\uD800-\uDFFFa-][^\uD800-\uDFFF\w-][^\uD800-\uDFFF\-a]"),  # a last "-" stays literal
    (r"[\-.\]a-z]", r"[\-.\]a-z]"),
    (r"[\u{0}-\u{10FFFF}][\x0-\xFFFF][\b-\uFFFF]",
     r"[\u{0}-\uD7FF\uE000-\u{10FFFF}][\x0-\uD7FF\uE000-\xFFFF][\b-\uD7FF\uE000-\uFFFF]"),
    (r"\uD83D\uDE00[\uD83D\uDE00-\uD83D\uDE4F]", r"\u{1F600}[\u{1F600}-\u{1F64F}]"),  # JavaScript's pairs
    ("[a", "[a"),  # unterminated: left for xgrammar to refuse
])
def test_text_only_regex_rewrites_what_admits_surrogates(regex: str, rewritten: str) -> None:
    assert text_only_regex(regex) == rewritten


@pytest.mark.parametrize("regex", [r"a\uD800", r"\uDE00\uD83D", r"[\uD800-\uDBFF]"])
def test_text_only_regex_refuses_what_can_only_be_a_surrogate(regex: str) -> None:
    with pytest.raises(ValueError, match="surrogate"):
        text_only_regex(regex)


REGEX = r"^a.[^x]\S[\u0000-\uffff][b\D]$"
SURROGATE = b"\xed\xa0\x80"


@pytest.mark.parametrize("position", range(1, 6))
def test_regex_constraints_admit_text_and_no_surrogate(position: int) -> None:
    text = "a\u20ac\U0001F600y\uFFFDz".encode()
    assert testing._is_grammar_accept_string(_regex_grammar(REGEX), text)
    chars = ["a", "\u20ac", "\U0001F600", "y", "\uFFFD", "z"]
    broken = b"".join(SURROGATE if i == position else c.encode() for i, c in enumerate(chars))
    assert not testing._is_grammar_accept_string(_regex_grammar(REGEX), broken)


def _regex_grammar(regex: str) -> xgr.Grammar:
    return xgr.Grammar.from_regex(text_only_regex(regex))


def test_regex_kind_compiles_the_text_only_expression() -> None:
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2]))
    for output, accepted in ((b"a\xe2\x82\xac", True), (b"a" + SURROGATE, False)):
        matcher = xgr.GrammarMatcher(compile_constraint(compiler, "regex", "^a.$", []))
        assert matcher.accept_string(output) is accepted


PATTERN_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^.{2}$"},
                   "pattern": {"type": "string", "maxLength": 3}},  # a property named "pattern": not a regex
    "patternProperties": {"^x.$": {"type": "string", "pattern": "^[^0-9]$"}},
    "required": ["code", "pattern"], "additionalProperties": False})


@pytest.mark.parametrize(("document", "accepted"), [
    ('{"code": "\u00e9\U0001F600", "pattern": "abc"}'.encode(), True),
    ('{"code": "\u00e9\U0001F600", "pattern": "abc", "x\u20ac": "\u00e9"}'.encode(), True),
    (b'{"code": "a' + SURROGATE + b'", "pattern": "abc"}', False),
    (b'{"code": "ab", "pattern": "abc", "x' + SURROGATE + b'": "b"}', False),
    (b'{"code": "ab", "pattern": "abc", "xy": "' + SURROGATE + b'"}', False),
    (b'{"code": "ab", "pattern": "abc", "xy": "7"}', False),
])
def test_schema_patterns_admit_text_and_no_surrogate(document: bytes, accepted: bool) -> None:
    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(PATTERN_SCHEMA, strict_mode=True))
    assert testing._is_grammar_accept_string(grammar, document) is accepted


@pytest.mark.parametrize("format_name", ["json-pointer", "relative-json-pointer"])
def test_json_pointer_formats_admit_text_and_no_surrogate(format_name: str) -> None:
    # xgrammar spells these formats' characters past DEL as one class up to U+10FFFF.
    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps({"type": "string", "format": format_name}),
                                                     strict_mode=True))
    prefix = b'"/' if format_name == "json-pointer" else b'"0/'
    assert testing._is_grammar_accept_string(grammar, prefix + "\u00e9\U0001F600".encode() + b'"')
    assert not testing._is_grammar_accept_string(grammar, prefix + SURROGATE + b'"')



@pytest.mark.parametrize(("regex", "output", "accepted"), [
    (r"^[^\w-]$", b"!", True), (r"^[^\w-]$", b"-", False), (r"^[^\w-]$", b"x", False),
    (r"^[^a-]$", "\u00e9".encode(), True), (r"^[^a-]$", b"-", False), (r"^[^a-]$", SURROGATE, False),
    (r"^\uD83D\uDE00$", "\U0001F600".encode(), True), (r"^\uD83D\uDE00$", b"\xed\xa0\xbd\xed\xb8\x80", False),
])
def test_rewritten_classes_keep_their_meaning(regex: str, output: bytes, accepted: bool) -> None:
    # The surrogates go first in a negated class, so a last "-" stays a literal (after them it would
    # have made a range); a pair of \u escapes is the character it encodes, not two surrogates.
    assert testing._is_grammar_accept_string(_regex_grammar(regex), output) is accepted
