"""The request bodies of the OpenAI-compatible API, as pydantic models: types only, no limits.

Why types only: every bound (temperature >= 0, n <= max_n, stop strings per request, the model's
length) is the gRPC API's, checked once by the gateway core's ``validate`` on the converted request. These
models only say what JSON shape each field has, so that a wrong type is a 400 naming the field
rather than a TypeError deep inside. Unknown fields are accepted (``extra="allow"``) and logged, as
vLLM does: clients send fields of newer API versions, and refusing them would break them.
"""

from __future__ import annotations

import itertools
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.errors import ECHO_CHARS

# Unknown field names one log line repeats (each cut to ECHO_CHARS); the others are only counted.
NUM_LOGGED_UNKNOWN_FIELDS = 5


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingExtensions(Body):
    """Sampling fields beyond the Responses API's own that every generating endpoint takes: chat
    and completions' OpenAI ones and vLLM's extensions users rely on (``/v1/responses`` takes them
    too, through the SDK's ``extra_body``)."""

    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    cache_salt: str | None = None


class _Sampling(SamplingExtensions):
    """Fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None  # the prompt's tokens scored (not with stream; vLLM's)
    # Structured outputs (gateway.openai_api.constraints): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt as a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(Body):
    type: str
    text: str | None = None


class FunctionCall(Body):
    name: str
    arguments: str  # the JSON text of an object, as OpenAI sends and expects it


class ToolCall(Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names its call


class FunctionDefinition(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the required/named output follows the schema whatever it says


class ToolDefinition(Body):
    type: str = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None


class TokenizeRequest(Body):
    """vLLM's ``POST /tokenize``: a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: as generation tokenizes it (a prompt gets BOS, a chat's template writes its own).
    add_special_tokens: bool | None = None
    # A chat ends with the assistant's turn opened (vLLM's default); False counts the chat as it is.
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


Endpoint = Literal["completions", "chat"]


def _cut(name: int | str) -> str:
    text = str(name)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def unknown_fields(body: BaseModel) -> dict[str, object]:
    """A log line's account of a body's unknown top-level fields: how many, and the first few names.

    Why not every name: a 4 MB body of 270k unknown fields made one 2.97 MB log line.
    """
    extra = body.model_extra or {}
    first = itertools.islice(extra, NUM_LOGGED_UNKNOWN_FIELDS)
    return {"num_fields": len(extra), "fields": [_cut(name) for name in first]}


def error_param(loc: tuple[int | str, ...], body: type[BaseModel] | None = None) -> str | None:
    """The parameter a pydantic error names (``messages.0.content``) as the client spells it, each
    part cut short: a part may be a client's dict key of any length (``logit_bias``'s).

    Why ``body``: pydantic's location of a value that fits no member of a union names the member
    it tried (``prompt.str``, ``messages.0.content.list[ContentPart].0.type``); walking the body's
    types tells those labels from field names and dict keys, and drops them.
    """
    kept: list[int | str] = []
    annotation: Any = body
    for part in loc:
        members = _members(annotation)
        if len(members) > 1:  # this part is the label of the member tried: not the client's
            annotation = next((m for m in members if _label(m) == part), None)
            continue
        annotation = members[0] if members else None
        kept.append(part)
        annotation = _inner(annotation, part)
    return ".".join(_cut(part) for part in kept) or None


def _members(annotation: Any) -> list[Any]:
    """A union's members without None (one for a plain or optional type; none for unknown)."""
    if annotation is None:
        return []
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _label(annotation: Any) -> str:
    """pydantic's name of a union member in an error's location (``list[int]``, ``ContentPart``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return f"list[{_label(args[0])}]"
    if origin is dict:
        return f"dict[{_label(args[0])},{_label(args[1])}]"
    return "any" if annotation is Any else getattr(annotation, "__name__", str(annotation))


def _inner(annotation: Any, part: int | str) -> Any:
    """The type of ``annotation``'s element ``part`` (a field, an index, a key); None: unknown."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(str(part))
        return field.annotation if field is not None else None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None
