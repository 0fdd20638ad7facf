"""Static limits on structured-output constraints, checked before anything compiles them.

A grammar engine's cost is not its text's length: the 16 characters ``(.{0,60}){0,60}x`` compile in
milliseconds, then each token mask costs more than the last (seconds within 30 tokens; Earley
states for the 60 x 60 ways to split the text), and a JSON schema nested 900 deep takes minutes to
compile. These rules refuse the shapes known to explode, from the text alone, in the gateway and
the compute service alike (no grammar engine here); what they let through is still probed by the
compiler (compute_service/structured/grammar_compiler.py) and bounded by the engine's mask deadline.

The rules:
  * nested repetitions: along any chain of counted repetitions nested in one another (``{m,n}``
    inside ``{m,n}``, in a regex, a grammar across its rules, or a schema's ``pattern``), the upper
    bounds multiply to at most MAX_NESTED_REPETITION (1,000). ``{m,}`` counts as m; ``*``, ``+``
    and ``?`` as 1 (a loop is one copy, a bound of n is n copies). A single bound is not nested
    and may be larger: ``.{0,5000}`` fills its masks as fast as ``.*``.
  * nesting: groups at most MAX_GROUP_DEPTH deep in a regex or grammar; a schema's subschemas at
    most MAX_SCHEMA_DEPTH deep (compile time grows with the cube of the depth: 0.02 s at 32 levels,
    0.75 s at 128), at most MAX_SCHEMA_NODES of them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from pagedserve import json_text
from pagedserve.errors import InvalidArgument

MAX_NESTED_REPETITION = 1000
MAX_GROUP_DEPTH = 64
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 4096

_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*::=", re.MULTILINE)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
# Schema keywords whose value is one subschema, a list of them, or a map of names to them; the
# others (enum, const, required, ...) hold data, never walked.
_ONE_SCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Annotations: no effect on what validates, so none on the grammar (dropped from cache keys).
_ANNOTATIONS = ("title", "description", "$comment", "examples")


class _Chain:
    """What a piece of a pattern holds: the largest product of counted-repetition bounds along a
    chain through it (0: no counted repetition), and the largest such product over chains of two
    or more (the nested ones)."""

    __slots__ = ("chain", "nested")

    def __init__(self, chain: int = 0, nested: int = 0) -> None:
        self.chain, self.nested = chain, nested

    def merge(self, other: _Chain) -> None:
        self.chain, self.nested = max(self.chain, other.chain), max(self.nested, other.nested)

    def repeated(self, bound: int) -> _Chain:
        """This piece under a quantifier with upper bound ``bound`` (1 for loops and options)."""
        if bound <= 1:
            return _Chain(self.chain, self.nested)
        return _Chain(bound * max(self.chain, 1), max(self.nested, bound * self.chain))


def _quantifier_at(text: str, i: int) -> tuple[int, int] | None:
    """(upper bound, length) of a quantifier starting at ``text[i]``, or None."""
    if i >= len(text):
        return None
    if text[i] in "*+?":
        return 1, 1
    match = _QUANTIFIER.match(text, i) if text[i] == "{" else None
    if match is None:
        return None
    low, comma, high = match.groups()
    bound = int(high) if comma and high else int(low)
    return bound, match.end() - i


def _walk(text: str, field: str, atom: Callable[[str, int], tuple[_Chain, int] | None]) -> _Chain:
    """Groups and quantifiers of a regex or a grammar's right-hand side; ``atom(text, i)`` reads the
    dialect's own atoms (classes, strings, escapes, rule names) as (chain, length), or None."""
    stack = [_Chain()]  # one per open group: what its contents hold so far
    i = 0
    while i < len(text):
        c = text[i]
        if c == "(":
            stack.append(_Chain())
            if len(stack) - 1 > MAX_GROUP_DEPTH:
                raise InvalidArgument(f"{field}: groups nest deeper than {MAX_GROUP_DEPTH} levels")
            i += 1
            continue
        if c == ")" and len(stack) > 1:
            piece, i = stack.pop(), i + 1
        else:
            read = atom(text, i)
            piece, length = read if read is not None else (_Chain(), 1)
            i += length
        while (quantifier := _quantifier_at(text, i)) is not None:
            bound, length = quantifier
            piece = piece.repeated(bound)
            i += length
        if piece.nested > MAX_NESTED_REPETITION:
            raise _nested_error(field, piece.nested)
        stack[-1].merge(piece)
    result = stack[0]
    for group in stack[1:]:
        result.merge(group)
    return result


def _nested_error(field: str, product: int) -> InvalidArgument:
    return InvalidArgument(f"{field}: nested repetitions multiply to {product} copies; the upper bounds of "
                           f"repetitions nested in one another may multiply to at most {MAX_NESTED_REPETITION}")


def _regex_atom(text: str, i: int) -> tuple[_Chain, int] | None:
    if text[i] == "\\":
        return _Chain(), 2
    if text[i] == "[":
        j = i + 1
        if j < len(text) and text[j] == "^":
            j += 1
        if j < len(text) and text[j] == "]":
            j += 1
        while j < len(text) and text[j] != "]":
            j += 2 if text[j] == "\\" else 1
        return _Chain(), j + 1 - i
    if text[i] == "(" or text[i] == ")":
        return None
    return _Chain(), 1


def check_regex(field: str, pattern: str) -> None:
    """Raise InvalidArgument naming ``field`` when the pattern breaks the module's rules."""
    _walk(pattern, field, _regex_atom)


def check_grammar(field: str, ebnf: str) -> None:
    """The rules for an EBNF grammar, products followed across rule references (a reference on a
    cycle counts as no repetition: recursion is how grammars loop)."""
    starts = [(m.group(1), m.start(), m.end()) for m in _RULE.finditer(ebnf)]
    bodies: dict[str, str] = {}
    for k, (name, _, end) in enumerate(starts):
        body = ebnf[end: starts[k + 1][1] if k + 1 < len(starts) else len(ebnf)]
        bodies[name] = bodies.get(name, "") + " | " + body if name in bodies else body
    done: dict[str, _Chain] = {}
    active: set[str] = set()

    def rule(name: str) -> _Chain:
        if name in done:
            return done[name]
        if name in active or name not in bodies:
            return _Chain()
        active.add(name)
        done[name] = result = _walk(bodies[name], field, atom)
        active.discard(name)
        return result

    def atom(text: str, i: int) -> tuple[_Chain, int] | None:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            return _Chain(), j + 1 - i
        if c == "[":
            return _regex_atom(text, i)
        if c == "#":  # a comment, to the end of its line
            end = text.find("\n", i)
            return _Chain(), (len(text) if end < 0 else end) - i
        match = _IDENT.match(text, i)
        if match is not None:
            referenced = rule(match.group(0))
            return _Chain(referenced.chain, referenced.nested), match.end() - i
        return None

    for name in bodies:
        rule(name)


def check_json_schema(field: str, spec: str) -> None:
    """A schema's depth and size, and every ``pattern`` in it by the regex rules. Text that is not
    JSON passes: the compiler says why it is invalid."""
    try:
        schema = json.loads(spec)
    except RecursionError:
        raise InvalidArgument(f"{field}: nested deeper than the JSON parser allows") from None
    except ValueError:
        return
    num_nodes = 0
    for node, depth, where in _subschemas(schema):
        num_nodes += 1
        if num_nodes > MAX_SCHEMA_NODES:
            raise InvalidArgument(f"{field}: more than {MAX_SCHEMA_NODES} subschemas")
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidArgument(f"{field}: subschemas nest deeper than {MAX_SCHEMA_DEPTH} levels")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(f"{field} (pattern at {where})", pattern)
        for name in node.get("patternProperties") or {}:
            check_regex(f"{field} (patternProperties at {where})", name)


def _subschemas(schema: Any, depth: int = 0, where: str = "#") -> Iterator[tuple[dict, int, str]]:
    """Every subschema (a dict in a schema position) with its depth and JSON pointer; iterative in
    spirit (bounded by MAX_SCHEMA_DEPTH: the caller stops at the first one too deep)."""
    if not isinstance(schema, dict):
        return
    yield schema, depth, where
    if depth > MAX_SCHEMA_DEPTH:
        return
    for key, value in schema.items():
        if key in _SCHEMA_MAP and isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, depth + 1, f"{where}/{key}/{name}")
        elif key in _SCHEMA_LIST and isinstance(value, list):
            for k, sub in enumerate(value):
                yield from _subschemas(sub, depth + 1, f"{where}/{key}/{k}")
        elif key in _ONE_SCHEMA:
            yield from _subschemas(value, depth + 1, f"{where}/{key}")


def normalized_json_schema(spec: str) -> str:
    """The schema without annotations (title, description, $comment, examples: none changes what
    validates) in compact JSON, key order kept (it orders the output's properties). Two requests
    that differ only there compile to the same grammar, and share its cache entry and verdict."""
    stripped = map_subschemas(json.loads(spec), lambda node: {k: v for k, v in node.items() if k not in _ANNOTATIONS})
    return json_text.dumps(stripped, separators=(",", ":"))


def map_subschemas(schema: Any, each: Callable[[dict], dict]) -> Any:
    """`schema` rebuilt with `each` applied to every subschema (a dict in a schema position, the ones
    `_subschemas` walks), its own subschemas done first; anything else is kept as it is."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAP and isinstance(value, dict):
            value = {name: map_subschemas(sub, each) for name, sub in value.items()}
        elif key in _SCHEMA_LIST and isinstance(value, list):
            value = [map_subschemas(sub, each) for sub in value]
        elif key in _ONE_SCHEMA:
            value = map_subschemas(value, each)
        out[key] = value
    return each(out)


def map_patterns(schema: Any, rewrite: Callable[[str], str]) -> Any:
    """`schema` with `rewrite` applied to every regular expression in it: each subschema's "pattern"
    and the names of its "patternProperties" (those `check_json_schema` checks)."""
    def each(node: dict) -> dict:
        out = dict(node)
        if isinstance(node.get("pattern"), str):
            out["pattern"] = rewrite(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            out["patternProperties"] = {rewrite(name): sub for name, sub in node["patternProperties"].items()}
        return out

    return map_subschemas(schema, each)


def check_spec(kind: str, spec: str, field: str) -> None:
    """The rules for a constraint of ``kind`` ("regex", "grammar", "json_schema"; others pass)."""
    if kind == "regex":
        check_regex(field, spec)
    elif kind == "grammar":
        check_grammar(field, spec)
    elif kind == "json_schema":
        check_json_schema(field, spec)
