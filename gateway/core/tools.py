"""Tool calling for both fronts: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

What a request's tools become, in four steps, all in the gateway (the compute service only sees a
prompt and, for ``required`` and a named function, a JSON-schema constraint):

1. ``plan``: the tools are checked (names, duplicates, schemas: INVALID_ARGUMENT naming ``tools``,
   ``tool_choice`` or ``messages``), and ``required`` / a named function become a JSON schema that
   the structured-output path (xgrammar, in the compute service) holds the output to, so every call
   parses and its arguments validate: a named function's output is its arguments object; a
   ``required`` output is ``[{"name": ..., "arguments": {...}}, ...]`` (one item without
   ``parallel_tool_calls``). The wire carries nothing new to the engine.
2. ``template_messages``: the chat as the template takes it. A template that knows tools (its text
   mentions ``tools``, as Qwen2.5's, SmolLM3's and Llama 3.x's do) gets OpenAI-shaped messages and
   ``tools=``. Any other template (the default model's plain ChatML) gets the generic rendering
   below: the tools' signatures and the parser's call format (Hermes unless the flag says
   otherwise) appended to the system turn (one is added when there is none), an assistant's earlier
   calls written into its content in that format, and a tool's answer as a user turn in ``<tool_response>`` tags (every
   template takes user turns; many refuse a "tool" role). With ``tool_choice: none`` the tools are
   left out of the prompt.
3. ``with_tool_calls``: each completion's deltas as they come; at its end the text is parsed into
   calls. ``auto`` reads the model's own format (``gateway.core.tool_parsers``: Hermes
   ``<tool_call>{"name", "arguments"}</tool_call>`` or Llama 3's JSON, chosen from the chat template
   or by ``--tool-call-parser``): text before the first call streams as content, the rest is held
   until the end, and a call that is unfinished or does not parse (or names no given tool) comes
   back as plain content with the completion's own finish reason, as vLLM does. A completion with calls ends with
   ``finish_reason: "tool_calls"`` and its calls in one delta, so a stream's pieces reassemble to
   the unary answer exactly.
4. The fronts write the calls in their shapes (OpenAI's ``message.tool_calls`` / ``delta.tool_calls``,
   the gRPC ``Completion.tool_calls``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from gateway.core.tool_parsers import PARSERS, ToolCallParser, call_of, new_call, new_call_id
from gateway.core.types import ChatMessage, Constraint, Delta, GenerateRequest, Tool, ToolCall
from pagedserve import json_text
from pagedserve.errors import InvalidArgument, echo

MAX_TOOLS = 128  # OpenAI's bound
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (vLLM also allows dots)
CHOICES = ("none", "auto", "required", "function")
# A tool without parameters takes an empty object (and nothing else: an open object would let a
# constrained model write keys until max_tokens).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
HERMES = PARSERS["hermes"]
# The start of a "required" output's unfinished item, up to its arguments' text (names have no quotes
# or escapes: _NAME).
_UNFINISHED_CALL = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*')

# The generic rendering of tools into the system turn, for templates without a tools branch (the
# parser's instructions follow).
GENERIC_TOOLS_PROMPT = """# Tools

You may call these functions (signatures as JSON, one per line):
<tools>
{signatures}
</tools>

"""


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for it.

    Attributes:
        mode: "auto", "required" or "function" ("none" has no plan).
        tools: by name, with their parsed parameter schemas.
        function: the named function (mode "function").
        parallel: several calls allowed in one answer.
        parser: the model's call format (mode "auto").
    """

    mode: str
    tools: dict[str, dict]
    function: str = ""
    parallel: bool = True
    parser: ToolCallParser = HERMES

    def constraint(self) -> Constraint | None:
        """The output's JSON schema for "required" and a named function (None for "auto")."""
        if self.mode == "function":
            return Constraint("json_schema", json.dumps(self.tools[self.function], separators=(",", ":")))
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, schema in self.tools.items()]
            schema: dict = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                            "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) of a finished completion's text; None when it holds no (valid) call."""
        if self.mode == "auto":
            parsed = self.parser.parse(text, self.tools)
            if parsed is not None and not self.parallel:
                return parsed[0], parsed[1][:1]
            return parsed
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # unfinished (length, a stop string), or nested past the decoder
            return None
        if self.mode == "function":
            return ("", [new_call(self.function, value)]) if isinstance(value, dict) else None
        if not isinstance(value, list) or not value:
            return None
        calls = [call_of(item, self.tools) for item in value]
        return None if any(c is None for c in calls) else ("", calls)  # type: ignore[return-value]

    def partial(self, text: str) -> list[ToolCall]:
        """The calls of a "required" or named output cut short by max_tokens: those complete, then
        the unfinished one with its arguments' text so far (not valid JSON), as vLLM answers it.

        The grammar fixed the output's shape (the arguments object; or ``[{"name": ..., "arguments":
        ...}, ...]``, name first, as the schema orders it), so only where it stops is unknown.
        """
        if self.mode == "function":
            return [ToolCall(new_call_id(), self.function, text)]
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = text.find("[") + 1
        while pos:
            pos = len(text) - len(text[pos:].lstrip(" \n\t,"))
            try:
                item, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):  # the unfinished item
                break
            call = call_of(item, self.tools)
            if call is None:
                return calls
            calls.append(call)
        unfinished = _UNFINISHED_CALL.match(text, pos) if pos else None
        if unfinished is not None and unfinished["name"] in self.tools:
            calls.append(ToolCall(new_call_id(), unfinished["name"], text[unfinished.end():]))
        return calls


# --- the request ---------------------------------------------------------------------------------


def _schema(i: int, tool: Tool) -> dict:
    if not tool.parameters:
        return dict(NO_PARAMETERS)
    try:
        schema = json.loads(tool.parameters)
    except ValueError as exc:
        raise InvalidArgument(f"tools[{i}].parameters: not valid JSON ({exc})") from None
    except RecursionError:  # Python's decoder gives up past its recursion limit
        raise InvalidArgument(f"tools[{i}].parameters: nested too deeply") from None
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise InvalidArgument(f"tools[{i}].parameters must be a JSON schema of an object")
    import jsonschema  # the gateway's only use of it: loaded with the first request that has tools

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError:  # a schema parsed within the decoder's depth but deeper than the checker's
        raise InvalidArgument(f"tools[{i}].parameters: nested too deeply") from None
    except jsonschema.SchemaError as exc:
        raise InvalidArgument(f"tools[{i}].parameters: invalid JSON schema: {echo(exc.message, 200)}") from None
    return schema


def _check_history(messages: Sequence[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(f"messages[{i}].tool_calls: only an assistant message makes calls")
        if message.tool_call_id and message.role != "tool":
            raise InvalidArgument(f"messages[{i}].tool_call_id: only a tool message answers a call")
        for j, call in enumerate(message.tool_calls):
            if not _NAME.fullmatch(call.name):
                raise InvalidArgument(f"messages[{i}].tool_calls[{j}].name must be 1 to 64 letters, digits, "
                                      f"'_', '-' or '.', got {echo(call.name)}")
            try:
                arguments = json.loads(call.arguments or "{}")
            except (ValueError, RecursionError):  # nested past the decoder's depth: bad input, not a bug
                arguments = None
            if not isinstance(arguments, dict):
                raise InvalidArgument(f"messages[{i}].tool_calls[{j}].arguments must be the JSON text of an object")


def plan(request: GenerateRequest, parser: ToolCallParser = HERMES) -> ToolPlan | None:
    """The request's tool plan (None: no tools, or ``tool_choice`` "none"), its input checked;
    ``parser`` reads the model's calls under ``auto``.

    Raises:
        InvalidArgument: naming ``tools[i]...``, ``tool_choice``, ``parallel_tool_calls`` or
            ``messages[i].tool_calls...``.
    """
    _check_history(request.messages or ())
    tools = request.tools or []
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice not in CHOICES:
        raise InvalidArgument(f"tool_choice must be one of {', '.join(CHOICES[:3])} or a function, got {echo(choice)}")
    if (tools or request.tool_choice) and not request.messages:
        raise InvalidArgument("tools: only for chats (messages)")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            raise InvalidArgument(f"tools[{i}].name must be 1 to 64 letters, digits, '_', '-' or '.', "
                                  f"got {echo(tool.name)}")
        if tool.name in schemas:
            raise InvalidArgument(f"tools[{i}].name: {tool.name!r} is given twice")
        schemas[tool.name] = _schema(i, tool)
    if choice in ("required", "function") and not tools:
        raise InvalidArgument(f"tool_choice {choice!r} needs tools")
    if choice == "function" and request.tool_function not in schemas:
        raise InvalidArgument(f"tool_choice: function {echo(request.tool_function)} is not one of the tools")
    if choice in ("required", "function") and request.options.constraint is not None:
        raise InvalidArgument(f"tool_choice {choice!r} constrains the output itself: give no response_format "
                              "or other constraint with it")
    if choice == "none":
        return None
    return ToolPlan(choice, schemas, request.tool_function, request.parallel_tool_calls is not False, parser)


def constrained(request: GenerateRequest, tool_plan: ToolPlan | None) -> GenerateRequest:
    """The request with the plan's constraint (the same request when it has none)."""
    constraint = tool_plan.constraint() if tool_plan is not None else None
    if constraint is None:
        return request
    return dataclasses.replace(request, options=dataclasses.replace(request.options, constraint=constraint))


# --- the prompt ----------------------------------------------------------------------------------


def _openai_tool(tool: Tool) -> dict:
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = json_text.loads(tool.parameters) if tool.parameters else dict(NO_PARAMETERS)
    return {"type": "function", "function": function}


def template_messages(request: GenerateRequest, native: bool,
                      parser: ToolCallParser = HERMES) -> tuple[list[dict], list[dict] | None]:
    """The chat as the template takes it, and its ``tools=`` argument (None: no tools to render).

    Args:
        native: the template renders tools and tool calls itself.
        parser: the call format the generic rendering asks for and writes earlier calls in.
    """
    messages = request.messages or []
    tools = request.tools if request.tools and request.tool_choice != "none" else None
    if native:
        out = []
        for m in messages:
            message: dict = {"role": m.role, "content": m.content}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json_text.loads(c.arguments or "{}")}} for c in m.tool_calls]
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out, [_openai_tool(t) for t in tools] if tools else None
    out = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        elif m.tool_calls:
            calls = parser.call_text(m.tool_calls)
            out.append({"role": m.role, "content": f"{m.content}\n{calls}" if m.content else calls})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools:
        block = GENERIC_TOOLS_PROMPT.format(signatures="\n".join(json_text.dumps(_openai_tool(t))
                                                                 for t in tools)) + parser.instructions
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


# --- the answer ----------------------------------------------------------------------------------


@dataclass
class _Completion:
    """One completion's text held back from the stream, and its last token."""

    held: str = ""
    capturing: bool = False  # auto: a call has begun, everything from it waits for the end
    at_start: bool = True  # nothing but whitespace has streamed
    last_token_id: int | None = None

    def feed(self, text: str, hold_all: bool, parser: ToolCallParser) -> str:
        """The text that may stream now; the rest is held."""
        self.held += text
        if hold_all or self.capturing:
            return ""
        num_released, self.capturing = parser.split(self.held, self.at_start)
        released, self.held = self.held[:num_released], self.held[num_released:]
        self.at_start = self.at_start and not released.strip()
        return released


async def with_tool_calls(deltas: AsyncIterator[Delta], tool_plan: ToolPlan,
                          token_text: Callable[[int], str]) -> AsyncIterator[Delta]:
    """The deltas of a request with tools: each completion's calls parsed at its end.

    Token ids, logprobs and usage pass through as they come; text that may be a call is held until
    the completion ends. A completion whose text holds calls ends with finish_reason "tool_calls"
    and its calls; otherwise its held text comes out as content with its own finish reason.

    Args:
        token_text: a token's text (a completion ended by an EOS token whose text the detokenizer
            kept, as a model whose EOS is an ordinary token has it, is parsed without it).
    """
    completions: dict[int, _Completion] = {}
    hold_all = tool_plan.mode != "auto"
    async for delta in deltas:
        c = completions.setdefault(delta.index, _Completion())
        if delta.token_ids:
            c.last_token_id = delta.token_ids[-1]
        released = c.feed(delta.text, hold_all, tool_plan.parser)
        if not delta.finish_reason:
            yield dataclasses.replace(delta, text=released)
            continue
        text = c.held
        if delta.finish_reason == "eos" and c.last_token_id is not None:
            eos_text = token_text(c.last_token_id)
            if eos_text and text.endswith(eos_text):
                text = text[: -len(eos_text)]
        parsed = tool_plan.parse(text) if text.strip() else None
        if parsed is None and hold_all and delta.finish_reason == "length":  # a forced call cut short
            yield dataclasses.replace(delta, text="", tool_calls=tool_plan.partial(text))
        elif parsed is None:
            yield dataclasses.replace(delta, text=released + c.held)
        else:
            content, calls = parsed
            yield dataclasses.replace(delta, text=released + content, tool_calls=calls, finish_reason="tool_calls")
        c.held = ""
