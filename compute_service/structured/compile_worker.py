"""A grammar compile worker: its own process, so that a compile past its timeout can be killed.

    python compute_service/structured/compile_worker.py --parent-pid PID --read-fd R --write-fd W

Started by ``GrammarCompiler`` (grammar_compiler.py), one per worker slot, as a script: it imports
xgrammar, numpy and pagedserve.grammar_limits (text rules, no model), not the compute_service package
(the model, transformers: seconds more at every start, and a worker is restarted after each kill).
It receives the tokenizer once, then one job at a time: (kind, spec, choices) in, ("ok", the
compiled grammar serialized as JSON) or ("invalid", the reason) out. Before a grammar is answered
"ok" its mask cost is probed (``probe_masks``): a constraint whose masks are slow is refused here,
at admission, rather than slowing the engine's steps.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import signal
import sys
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import NamedTuple

import numpy as np
import xgrammar as xgr

from pagedserve import grammar_limits

# Part of every cache key: change it when the options below change what a constraint compiles to.
COMPILE_OPTIONS = "xgrammar-v2:any_whitespace=False,strict_mode=True,no-surrogates,text-only-regex"
# xgrammar prefixes its messages with "[time] /path/file.cc:line: " and sometimes a failed check's text.
_ENGINE_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_MAX_MESSAGE_CHARS = 500
# The worker's nice value, set by its parent as it starts (grammar_compiler._Worker: its own start,
# importing xgrammar, runs niced too). A compile is CPU-bound for up to its timeout, and on a machine
# whose cores the engine's threads fill, a worker at the engine's priority takes half a core from one
# of them, which holds every step's parallel region. At nice 5 it gets about a quarter of a busy core
# (CFS weights 335 against 1024), and all of an idle one; the timeout counts CPU time
# (``GrammarCompilerConfig``), so a busy machine makes a compile slower, not refused as too complex.
WORKER_NICE = 5
# xgrammar 0.2's rules for a JSON string's characters let through what is not text: its rule for a
# length-bounded string (maxLength/minLength) raw control characters, which no strict JSON parser
# accepts (its unbounded rule excludes them), and both rules UTF-8-encoded surrogates (bytes ED A0-BF
# xx), which are not UTF-8: decoded, each byte became a U+FFFD, so a sampled value of 6 characters
# read as 8 and broke its schema's maxLength. We compile the schema's EBNF with both character
# classes replaced by one that excludes both.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'
# The same holds for a regular expression's `.`, its negated classes and \S \D \W, and ranges across
# U+D800-DFFF: xgrammar admits the surrogates' encodings there too, in a `regex` constraint and in a
# schema's `pattern`. `text_only_regex` rewrites the expression so that none of them admits one.
_NO_SURROGATES = r"\uD800-\uDFFF"
_SURROGATES = (0xD800, 0xDFFF)


@dataclass(frozen=True)
class ProbeConfig:
    """How a compiled grammar's mask cost is probed before it is accepted.

    Attributes:
        num_paths: sampled outputs walked, each from the start.
        num_steps: tokens along each (a path ends early where only a stop token is allowed).
        max_fill_s: CPU seconds one token mask may take (CPU, not wall: a loaded machine does not
            make a grammar costly). Ordinary grammars fill in well under a millisecond.
        seed: the paths' seed, so a constraint's verdict does not depend on the draw.
    """

    num_paths: int = 2
    num_steps: int = 32
    max_fill_s: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_paths < 0 or self.num_steps < 0:
            raise ValueError(f"num_paths and num_steps must be >= 0, got {self.num_paths}, {self.num_steps}")
        if not self.max_fill_s > 0:
            raise ValueError(f"max_fill_s must be > 0, got {self.max_fill_s}")


def engine_message(exc: BaseException) -> str:
    """The grammar engine's own words, without its source-file prefix, bounded in length."""
    text = _ENGINE_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF alternation of string literals; JSON escaping is also EBNF string escaping."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_constraint(compiler: xgr.GrammarCompiler, kind: str, spec: str,
                       choices: Sequence[str]) -> xgr.CompiledGrammar:
    """Raises RuntimeError/ValueError/TypeError (the engine's verdict) when the text is invalid."""
    # Compact JSON (any_whitespace=False: ", " and ": " only) so a model cannot pad with
    # whitespace until max_tokens.
    if kind == "json_schema":
        try:
            json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        return _compile_json_schema(compiler, spec, strict_mode=True)
    if kind == "json_object":
        # strict_mode=False: any keys and values (strict mode would forbid undeclared properties).
        return _compile_json_schema(compiler, '{"type": "object"}', strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(text_only_regex(spec))
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(choices))
    return compiler.compile_grammar(spec)


def json_schema_ebnf(schema: str, *, strict_mode: bool) -> str:
    """The EBNF a JSON schema compiles to: xgrammar's, its strings' characters corrected (above), its
    `pattern`s and `patternProperties` made text-only (`text_only_regex`), and the class its
    json-pointer formats spell out cut around the surrogates."""
    parsed = json.loads(schema)
    rewritten = grammar_limits.map_patterns(parsed, text_only_regex)
    if rewritten != parsed:  # else the text as sent, untouched by a round trip through Python
        schema = json.dumps(rewritten)
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
    ebnf = ebnf.replace(_BOUNDED_STRING_CHAR, _STRING_CHAR).replace(_JSON_STRING_CHAR, _STRING_CHAR)
    return ebnf.replace(_POINTER_CHARS, _POINTER_TEXT_CHARS)


# xgrammar's "json-pointer" and "relative-json-pointer" formats: an unescaped character past DEL.
_POINTER_CHARS = r"[\x7f-\U0010ffff]"
_POINTER_TEXT_CHARS = r"[\x7f-\ud7ff\ue000-\U0010ffff]"


def text_only_regex(regex: str) -> str:
    r"""`regex` with nothing in it that admits U+D800-DFFF (whose UTF-8 encodings are not text).

    `.` becomes [^\uD800-\uDFFF]; a negated class, and \S \D \W outside a class, get the surrogates
    added to what they exclude; in a class that is not negated, a range across them is cut around
    them and a \S \D \W is taken out into an alternative (`[a\S]` -> `([a]|[^\s\uD800-\uDFFF])`); a
    surrogate pair written as two \u escapes (as JavaScript spells U+10000 and up) becomes the one
    character it encodes. Other escapes are kept as written; an unterminated class is left for
    xgrammar to refuse. Raises ValueError for a lone surrogate, or a class of surrogates only.
    """
    out: list[str] = []
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            atom = _char(regex, i)
            if atom.code is not None and _is_surrogate(atom.code):
                raise ValueError(f"{atom.text} is a lone surrogate (U+D800-DFFF), not text")
            nxt = regex[i + 1]
            out.append(f"[^\\{nxt.lower()}{_NO_SURROGATES}]" if nxt in "SDW" else atom.text)
            i = atom.end
        elif c == ".":
            out.append(f"[^{_NO_SURROGATES}]")
            i += 1
        elif c == "[":
            end = _class_end(regex, i)
            if end < 0:
                out.append(regex[i:])
                break
            out.append(_text_only_class(regex[i + 1:end]))
            i = end + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _is_surrogate(code: int) -> bool:
    return _SURROGATES[0] <= code <= _SURROGATES[1]


def _class_end(regex: str, start: int) -> int:
    """The index of the `]` that closes the class opened at `start`, or -1."""
    i = start + 1
    while i < len(regex):
        if regex[i] == "\\":
            i += 2
        elif regex[i] == "]":
            return i
        else:
            i += 1
    return -1


class _Atom(NamedTuple):
    """One character of a regex or a class, or an escape: its text as written, its code point (None
    for a shorthand such as \\d), the index after it."""

    text: str
    code: int | None
    end: int


_HEX = frozenset("0123456789abcdefABCDEF")
_CONTROLS = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "0": 0, "b": 8}  # \b: backspace (in a class)


def _atom(text: str, i: int) -> _Atom:
    r"""The character or escape at text[i], read as xgrammar reads it: \uHHHH, \u{H...}, \xH...
    (any number of digits), a control escape, a shorthand, or an escaped character."""
    if text[i] != "\\" or i + 1 >= len(text):
        return _Atom(text[i], ord(text[i]), i + 1)
    kind = text[i + 1]
    if kind == "u" and text[i + 2:i + 3] == "{":
        close = text.find("}", i + 3)
        digits = text[i + 3:close] if close > 0 else ""
        if digits and set(digits) <= _HEX:
            return _Atom(text[i:close + 1], int(digits, 16), close + 1)
    if kind == "u" and len(text[i + 2:i + 6]) == 4 and set(text[i + 2:i + 6]) <= _HEX:
        return _Atom(text[i:i + 6], int(text[i + 2:i + 6], 16), i + 6)
    if kind == "x":
        end = i + 2
        while end < len(text) and text[end] in _HEX:
            end += 1
        if end > i + 2:
            return _Atom(text[i:end], int(text[i + 2:end], 16), end)
    if kind in "sSdDwW":
        return _Atom(text[i:i + 2], None, i + 2)
    return _Atom(text[i:i + 2], _CONTROLS.get(kind, ord(kind)), i + 2)


def _char(text: str, i: int) -> _Atom:
    """`_atom`, with a surrogate pair of \\u escapes read as the one character it encodes."""
    atom = _atom(text, i)
    if atom.code is not None and 0xD800 <= atom.code <= 0xDBFF and text[atom.end:atom.end + 2] == "\\u":
        low = _atom(text, atom.end)
        if low.code is not None and 0xDC00 <= low.code <= 0xDFFF:
            code = 0x10000 + ((atom.code - 0xD800) << 10) + low.code - 0xDC00
            return _Atom(f"\\u{{{code:X}}}", code, low.end)
    return atom


def _text_only_class(body: str) -> str:
    """One class, `body` between its brackets, made text-only (see `text_only_regex`)."""
    if body.startswith("^"):  # the range first: a trailing "-" stays a literal
        rest = "\\-" + body[2:] if body.startswith("^-") else body[1:]
        return f"[^{_NO_SURROGATES}{rest}]"
    kept: list[str] = []
    taken_out: list[str] = []
    i = 0
    while i < len(body):
        atom = _char(body, i)
        i = atom.end
        if atom.code is None and atom.text[1] in "SDW":
            taken_out.append(f"[^\\{atom.text[1].lower()}{_NO_SURROGATES}]")
            continue
        if atom.code is not None and i + 1 < len(body) and body[i] == "-":
            hi = _char(body, i + 1)
            if hi.code is not None:
                kept.append(_cut_range(atom, hi))
                i = hi.end
                continue
        if atom.code is None or not _is_surrogate(atom.code):
            kept.append(atom.text)
    members = ([f"[{''.join(kept)}]"] if "".join(kept) else []) + taken_out
    if not members:
        raise ValueError(f"the class [{body}] admits only surrogates (U+D800-DFFF), which are not text")
    return members[0] if len(members) == 1 else "(" + "|".join(members) + ")"


def _cut_range(lo: _Atom, hi: _Atom) -> str:
    """lo-hi as written, or the parts of it outside U+D800-DFFF ("" if none)."""
    first, last = _SURROGATES
    if hi.code < first or lo.code > last:
        return f"{lo.text}-{hi.text}"
    parts = []
    if lo.code < first:
        parts.append(f"{lo.text}-\\u{first - 1:04X}")
    if hi.code > last:
        parts.append(f"\\u{last + 1:04X}-{hi.text}")
    return "".join(parts)


def _compile_json_schema(compiler: xgr.GrammarCompiler, schema: str, *, strict_mode: bool) -> xgr.CompiledGrammar:
    return compiler.compile_grammar(json_schema_ebnf(schema, strict_mode=strict_mode))


def probe_masks(grammar: xgr.CompiledGrammar, config: ProbeConfig) -> str | None:
    """Walk sampled outputs (a uniformly random allowed token at each step, stop tokens aside),
    filling the mask at every step; the reason the grammar is too costly, or None.

    Why sampled paths: a mask's cost depends on the state the output has reached (an ambiguous
    grammar's Earley states multiply with every token), and a model may take any allowed path."""
    info = grammar.tokenizer_info
    vocab_size = info.vocab_size
    stop_ids = set(info.stop_token_ids)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    rng = random.Random(config.seed)
    for _ in range(config.num_paths):
        matcher = xgr.GrammarMatcher(grammar)
        for step in range(config.num_steps):
            start = time.thread_time()
            matcher.fill_next_token_bitmask(bitmask)
            spent = time.thread_time() - start
            if spent > config.max_fill_s:
                return (f"too costly to follow: one token mask took {spent:.3f} s at token {step + 1} of a "
                        f"sampled output (the limit is {config.max_fill_s} s)")
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
            allowed = [t for t in np.flatnonzero(bits).tolist() if t not in stop_ids]
            if not allowed or not matcher.accept_token(rng.choice(allowed)):
                break
    return None


def serve(conn_in: Connection, conn_out: Connection) -> None:
    """The worker's loop: the setup message, then jobs until the parent closes the pipe."""
    tokenizer_json, probe_fields = conn_in.recv()
    probe = ProbeConfig(**probe_fields)  # sent as a dict: unpickling our class would import the package
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn_out.send(("ready", ""))
    while True:
        try:
            kind, spec, choices = conn_in.recv()
        except EOFError:
            return
        try:
            grammar = compile_constraint(compiler, kind, spec, choices)
            reason = probe_masks(grammar, probe)
        except (RuntimeError, ValueError, TypeError) as exc:  # the engine's verdict on the input
            conn_out.send(("invalid", engine_message(exc)))
            continue
        conn_out.send(("invalid", reason) if reason is not None else ("ok", grammar.serialize_json()))


def setup_message(tokenizer_json: str, probe: ProbeConfig) -> tuple[str, dict]:
    """What the parent sends first (plain data only)."""
    return tokenizer_json, dataclasses.asdict(probe)


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM when the parent dies, even by SIGKILL (``pagedserve.process.die_with_parent``, which
    this script does not import: it would bring gRPC in)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:
            sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m compute_service.structured.compile_worker")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--read-fd", type=int, required=True)
    parser.add_argument("--write-fd", type=int, required=True)
    args = parser.parse_args()
    _die_with_parent(args.parent_pid)
    # Ctrl-C in a terminal reaches the whole process group, so every worker printed a
    # KeyboardInterrupt traceback when `pagedserve up` stopped. A worker lives as long as its parent
    # wants it (it closes the pipe or kills it; its death sends SIGTERM): it ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(Connection(args.read_fd, writable=False), Connection(args.write_fd, readable=False))


if __name__ == "__main__":
    main()
