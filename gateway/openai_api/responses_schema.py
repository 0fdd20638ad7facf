"""The request body of OpenAI's Responses API (``POST /v1/responses``), as pydantic models: types only.

As ``schema``'s models: a wrong JSON type is a 400 naming the field, every bound is checked later
(the chat conversion's and the core's), and unknown fields are accepted and logged. Fields the
gateway reads but cannot honour (``reasoning``, built-in tools, ``background``, ``truncation`` other
than "disabled", ``max_tool_calls``, ``include``, ``prompt``, ``text.verbosity``) are typed here so
that ``responses_convert`` can refuse them by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gateway.openai_api.schema import Body, SamplingExtensions


class ContentPart(Body):
    """``input_text`` / ``output_text`` (text), or a part the gateway refuses (images, files, audio)."""

    type: str
    text: str | None = None


class InputItem(Body):
    """One item of ``input``: a message (``role`` and ``content``; ``type`` "message" or left out), an
    earlier ``function_call``, or a ``function_call_output`` answering one."""

    type: str | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: the JSON text of an object
    output: str | list[ContentPart] | None = None  # function_call_output


class ResponseTool(Body):
    """A function tool, flat (``name`` beside ``type``, unlike chat's ``function`` object); any
    other ``type`` is a built-in tool (``web_search``, ``file_search``, ...), refused."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Body):
    type: str = "text"
    name: str | None = None
    description: str | None = None
    json_schema: Any = Field(default=None, alias="schema")  # "schema" would shadow BaseModel's method
    strict: bool | None = None


class TextOptions(Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(SamplingExtensions):
    """``POST /v1/responses`` (with the sampling extensions chat takes, as vLLM's Responses API does)."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    stream: bool | None = False
    user: str | None = None
    truncation: str | None = None
    # Read to be refused when set (the gateway has no reasoning models, no background jobs, no
    # stored prompts, no truncation of a long conversation, no cap on calls): answering without
    # them would look like honouring them.
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    include: list[str] | None = None
    prompt: Any | None = None
