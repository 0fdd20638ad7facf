"""The formats models write tool calls in, for ``tool_choice: auto`` (``gateway.core.tools``).

Each parser says three things about its format: where a call may begin in a completion's text as it
streams (``split``: what may go out as content now, and whether a call has begun, after which the
rest is held until the completion ends), how to read the calls out of the finished text (``parse``:
None when there is no complete, valid call, and the whole text is then content, as vLLM does), and,
for templates without a tools branch, how the generic rendering asks for calls and writes earlier
ones into the history (``instructions``, ``call_text``).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after any content
  (Qwen2.5, SmolLM3, Hermes; the generic rendering's default).
- ``llama3_json``: Llama 3.1/3.2's ``{"name": ..., "parameters": {...}}`` as the whole answer,
  optionally after ``<|python_tag|>``, several separated by ``;``. A call only begins the answer:
  text that starts otherwise is content, all of it.

``choose`` picks one: the ``--tool-call-parser`` flag, or with ``auto`` from the chat template
(Hermes when it writes ``<tool_call>``, llama3_json when it writes ``<|python_tag|>`` or Llama 3's
``"parameters"`` call format, Hermes otherwise: the generic rendering asks for that format).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Protocol

from gateway.core.types import ToolCall
from pagedserve import json_text

PARSER_NAMES = ("auto", "hermes", "llama3_json")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(new_call_id(), name, json_text.dumps(arguments))


def call_of(value: object, tools: dict[str, dict]) -> ToolCall | None:
    """A call from ``{"name", "arguments"}`` (or Llama's and some Hermes models' "parameters"), if it
    names one of ``tools``."""
    if not isinstance(value, dict) or value.get("name") not in tools:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested past the decoder's depth
            return None
    return new_call(value["name"], arguments) if isinstance(arguments, dict) else None


def _arguments(call: ToolCall) -> dict:
    return json_text.loads(call.arguments or "{}")


class ToolCallParser(Protocol):
    name: str
    instructions: str  # the generic rendering's "how to call" paragraph

    def split(self, held: str, at_start: bool) -> tuple[int, bool]:
        """(characters of ``held`` that may stream as content now, whether a call has begun there).

        Args:
            held: the completion's text not streamed yet (no call has begun in it so far).
            at_start: nothing but whitespace has streamed before ``held``.
        """
        ...

    def parse(self, text: str, tools: dict[str, dict]) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) of a finished completion's text; None: no complete call of a given tool."""
        ...

    def call_text(self, calls: tuple[ToolCall, ...]) -> str:
        """An assistant's earlier calls as this format writes them (the generic rendering's history)."""
        ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks, after any content and followed by nothing else."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    instructions = """To call one, reply with a block per call:
<tool_call>
{"name": "<function name>", "arguments": <arguments object>}
</tool_call>"""

    def split(self, held: str, at_start: bool) -> tuple[int, bool]:
        start = held.find(self.OPEN)
        if start >= 0:
            return start, True
        # Hold a tail that may be the start of "<tool_call>".
        keep = next((k for k in range(min(len(self.OPEN) - 1, len(held)), 0, -1)
                     if self.OPEN.startswith(held[-k:])), 0)
        return len(held) - keep, False

    def parse(self, text: str, tools: dict[str, dict]) -> tuple[str, list[ToolCall]] | None:
        start = text.find(self.OPEN)
        if start < 0:
            return None
        calls, end = [], start
        for match in self._CALL.finditer(text, start):
            if text[end:match.start()].strip():
                return None
            try:
                call = call_of(json.loads(match.group(1)), tools)
            except (ValueError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
            end = match.end()
        if not calls or text[end:].strip():
            return None
        return text[:start], calls

    def call_text(self, calls: tuple[ToolCall, ...]) -> str:
        return "\n".join(f"{self.OPEN}\n{json_text.dumps({'name': c.name, 'arguments': _arguments(c)})}"
                         f"\n{self.CLOSE}" for c in calls)


class Llama3JsonParser:
    """Llama 3.x: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*`` as the whole answer."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    instructions = """To call one, reply with nothing but a JSON object per call (several separated by "; "):
{"name": "<function name>", "parameters": <arguments object>}"""

    def split(self, held: str, at_start: bool) -> tuple[int, bool]:
        if not at_start:
            return len(held), False  # content began the answer: it holds no call
        text = held.lstrip()
        if text.startswith(("{", self.TAG)):
            return 0, True
        if not text or self.TAG.startswith(text):
            return 0, False  # whitespace, or maybe the tag's start: wait
        return len(held), False

    def parse(self, text: str, tools: dict[str, dict]) -> tuple[str, list[ToolCall]] | None:
        text = text.strip()
        text = text.removeprefix(self.TAG).lstrip()
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        position = 0
        while True:
            try:
                value, end = decoder.raw_decode(text, position)
            except ValueError:  # not JSON, or unfinished
                return None
            call = call_of(value, tools)
            if call is None:
                return None
            calls.append(call)
            rest = text[end:].lstrip()
            if not rest:
                return "", calls
            if not rest.startswith(";"):
                return None
            rest = rest[1:].lstrip().removeprefix(self.TAG).lstrip()
            position = len(text) - len(rest)

    def call_text(self, calls: tuple[ToolCall, ...]) -> str:
        return "; ".join(json_text.dumps({"name": c.name, "parameters": _arguments(c)}) for c in calls)


PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def choose(name: str, chat_template: str) -> ToolCallParser:
    """The parser for ``--tool-call-parser name`` ("auto": from the chat template's text)."""
    if name != "auto":
        return PARSERS[name]
    if HermesParser.OPEN in chat_template:
        return PARSERS["hermes"]
    if Llama3JsonParser.TAG in chat_template or '"parameters"' in chat_template:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
