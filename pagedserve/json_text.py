"""JSON text that is always valid UTF-8.

A JSON string may spell a lone UTF-16 surrogate (``"\\ud83d"``): ``json.loads`` accepts it and gives
a Python str holding that surrogate, which no UTF-8 text can carry. Protobuf strings, HTTP bodies
and tokenizers all refuse it, so such a str written back with ``ensure_ascii=False`` fails far from
where it came in (an answer of 500). Model output can spell one (a sampled tool call's arguments),
and so can JSON text a client passes inside a string field (a tool's parameters, an earlier call's
arguments: our own answer, sent back in the next turn). Written: ``dumps`` escapes the surrogate.
Read for a prompt: ``loads`` replaces the surrogate, as a UTF-8 decoder replaces a bad byte.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, **kwargs)``, each lone surrogate written as its ``\\u``
    escape (the same JSON value); other scripts as they are. (``json.loads`` joins a pair into one
    character, so a surrogate left in a str is a lone one.)"""
    text = json.dumps(value, ensure_ascii=False, **kwargs)
    return text if is_text(text) else _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def is_text(text: str) -> bool:
    """Whether ``text`` is encodable as UTF-8 (holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def loads(text: str) -> Any:
    """``json.loads(text)``, each lone surrogate in its strings (keys included) replaced by U+FFFD, as a
    decoder replaces bytes that are not UTF-8: a value a chat template and a tokenizer can take.
    Raises what ``json.loads`` raises."""
    value = json.loads(text)
    return value if is_text(text) and "\\u" not in text else _replaced(value)


def _replaced(value: Any) -> Any:
    if isinstance(value, str):
        return value if is_text(value) else value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_replaced(item) for item in value]
    if isinstance(value, dict):
        return {_replaced(key): _replaced(item) for key, item in value.items()}
    return value
