"""A Responses API body as the chat body it means, so that one conversion serves both endpoints.

Why through ``ChatCompletionRequest`` rather than straight to the core's ``GenerateRequest``: the
chat path already turns messages, tools, ``tool_choice`` and ``response_format`` into the core's
request (``convert.chat_prompt``, ``constraints``) and its errors name the parameter; a second copy
of that for the Responses shapes would drift from it. What is the Responses API's own is here: its
input items to chat messages, its flat function tools and ``text.format`` to chat's, the
parameters it cannot honour refused by name, and the chat parameter names in errors mapped back to
its own (``RENAMED``).

The conversation a stored response continues (``previous_response_id``) is kept as chat messages
(``context``): the earlier input items and outputs, without their ``instructions``, which OpenAI
does not carry over from one response to the next.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.openai_api.errors import HttpError, ParamError, renamed_param
from gateway.openai_api.responses_schema import ContentPart, InputItem, ResponsesRequest, ResponseTool
from gateway.openai_api.schema import ChatCompletionRequest, SamplingExtensions
from pagedserve.errors import echo

# A chat parameter an error names -> the Responses parameter the client wrote.
RENAMED = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens"}
_CHAT_TURN = re.compile(r"^messages\[(\d+)\]")
# OpenAI's bounds on metadata.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
_TEXT_PARTS = ("input_text", "output_text", "text")


def renamed(error: HttpError) -> HttpError:
    """The error with the chat parameter it names replaced by the Responses one."""
    turn = _CHAT_TURN.match(error.message)
    if error.param == "messages" and turn is not None:  # where the instructions and earlier responses come first
        where = f"input (turn {turn[1]} of the conversation, instructions and earlier responses first)"
        return HttpError(error.status, where + error.message[turn.end():], "input")
    return renamed_param(error, RENAMED)


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming each parameter the gateway cannot honour, rather than an answer that ignores it."""
    if body.reasoning and any(value is not None for value in body.reasoning.values()):
        raise ParamError("reasoning", "reasoning is not supported: the served model is not a reasoning model")
    if body.background:
        raise ParamError("background", "background responses are not supported; use stream: true")
    if body.conversation is not None:
        raise ParamError("conversation", "conversations are not supported; use previous_response_id")
    if body.top_logprobs:
        raise ParamError("top_logprobs", "top_logprobs are not supported on /v1/responses; use /v1/chat/completions")
    if body.truncation not in (None, "disabled"):
        raise ParamError("truncation", f'truncation must be "disabled", got {echo(body.truncation)}: a conversation '
                                       "longer than the model's context is a 400, never cut silently")
    if body.max_tool_calls is not None:
        raise ParamError("max_tool_calls", "max_tool_calls is not supported; use parallel_tool_calls: false for "
                                           "at most one call")
    if body.include:
        raise ParamError("include", f"include is not supported (no reasoning, logprobs or built-in tool outputs to "
                                    f"add), got {echo(body.include)}")
    if body.prompt is not None:
        raise ParamError("prompt", "prompt (a stored prompt template) is not supported; send instructions and input")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise ParamError("text.verbosity", f"text.verbosity is not supported (only the default, medium), "
                                           f"got {echo(body.text.verbosity)}")
    if not body.input and body.previous_response_id is None:
        raise ParamError("input", "input is required (a string or a non-empty list of items)")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ParamError("metadata", f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ParamError("metadata", f"metadata: keys of at most {MAX_METADATA_KEY_CHARS} characters and values "
                                         f"of at most {MAX_METADATA_VALUE_CHARS}, got {echo(key)}")


def chat_body(body: ResponsesRequest, context: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat body a Responses body means, and the conversation so far (``context`` and this input).

    Args:
        context: the chat messages of the response ``previous_response_id`` names ([] for none).
    Raises:
        ParamError: naming the Responses parameter.
    """
    refuse_unsupported(body)
    conversation = context + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
                            "parallel_tool_calls": body.parallel_tool_calls, "user": body.user}
    chat.update({name: getattr(body, name) for name in SamplingExtensions.model_fields})
    if body.tools is not None:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.format is not None:
        response_format = _response_format(body.text.format)
        # A forced call is the whole answer, held to the tool's schema: text.format, which shapes
        # text, has nothing to shape (OpenAI takes both; the Agents SDK sends both when an agent
        # with an output type forces a tool). Chat refuses the pair; here the call wins.
        if not _forces_a_call(chat.get("tool_choice")):
            chat["response_format"] = response_format
    return ChatCompletionRequest.model_validate(chat), conversation


def input_messages(given: str | list[InputItem] | None) -> list[dict]:
    """Input items as chat messages: an assistant's message and the function calls after it are one
    assistant turn with ``tool_calls``; a ``function_call_output`` is a tool turn."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict] = []
    for i, item in enumerate(given):
        kind = item.type or ("message" if item.role is not None else "")
        if kind == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise ParamError("input", f"input[{i}].role must be user, system, developer or assistant, "
                                          f"got {echo(item.role)}")
            messages.append({"role": item.role, "content": _text(f"input[{i}].content", item.content)})
        elif kind == "function_call":
            call = {"id": _required(i, item, "call_id"), "type": "function",
                    "function": {"name": _required(i, item, "name"), "arguments": _required(i, item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _required(i, item, "call_id"),
                             "content": _text(f"input[{i}].output", item.output)})
        else:
            raise ParamError("input", f"input[{i}].type: {echo(kind or None)} is not supported; give messages, "
                                      "function_call and function_call_output items")
    return messages


def _required(i: int, item: InputItem, name: str) -> str:
    value = getattr(item, name)
    if value is None:
        raise ParamError("input", f"input[{i}].{name} is required for a {item.type} item")
    return value


def _text(name: str, content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in _TEXT_PARTS:
            raise ParamError("input", f"{name}: only text parts (input_text, output_text) are supported, "
                                      f"got {echo(part.type)}")
    return "".join(part.text or "" for part in content)


def _tool(i: int, tool: ResponseTool) -> dict:
    if tool.type != "function":
        raise ParamError("tools", f"tools[{i}]: the built-in tool {echo(tool.type)} is not supported; "
                                  "only function tools run here")
    if tool.name is None:
        raise ParamError("tools", f"tools[{i}].name is required")
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ParamError("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": '
                                    f'...}}; built-in tools are not supported, got type {echo(choice.get("type"))}')


def _forces_a_call(choice: str | dict | None) -> bool:
    return choice == "required" or isinstance(choice, dict)


def _response_format(given: Any) -> dict:
    if given.type == "json_schema":
        if given.json_schema is None:
            raise ParamError("text.format", "text.format.schema is required with type json_schema")
        return {"type": "json_schema", "json_schema": {"name": given.name or "response", "schema": given.json_schema,
                                                       "strict": given.strict}}
    if given.type in ("text", "json_object"):
        return {"type": given.type}
    raise ParamError("text.format", f"text.format.type must be text, json_object or json_schema, "
                                    f"got {echo(given.type)}")
