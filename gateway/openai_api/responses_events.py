"""Responses API answers: the response object, and its server-sent events as the SDKs parse them.

One answer has at most one message item (the text; first, since ``tool_choice: auto`` streams
text before any call begins) and then one ``function_call`` item per call. Its status:
``completed``, or ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"`` when
``max_output_tokens`` cut it short (the items too: a forced call cut short is a ``function_call``
whose ``arguments`` are unfinished, as chat answers it), or ``failed`` when the backend dropped it.

The stream, each event with its ``sequence_number``: ``response.created``, ``response.in_progress``;
for the text ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``... then ``.output_text.done``, ``.content_part.done``,
``.output_item.done``; for each call ``.output_item.added``, ``.function_call_arguments.delta``
(its arguments whole: the core hands a call over only once it is complete), ``.done``,
``.output_item.done``; last ``response.completed`` carrying the whole response.

Why ``response.completed`` also ends an incomplete response (OpenAI sends ``response.incomplete``
there): the SDK's ``responses.stream(...).get_final_response()`` and the Agents SDK's runner take
only ``response.completed`` as the end and raise without it; vLLM sends it for the same reason.
The response inside still says ``status: "incomplete"``. A failure after the first event is an
``error`` event whose data has a top-level ``error`` object, which the SDK raises as an APIError.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from gateway.core.types import Delta, ToolCall, Usage
from gateway.openai_api.responses_schema import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(usage: Usage | None) -> dict:
    u = usage or Usage()
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _function_call(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def _is_complete(call: ToolCall) -> bool:
    """Whether a call's arguments are the JSON text of an object (a call cut short has the start of one)."""
    try:
        return isinstance(json.loads(call.arguments or "{}"), dict)
    except ValueError:
        return False


@dataclass
class Output:
    """What the model produced, and how it ended."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage | None = None
    message_id: str = field(default_factory=lambda: new_id("msg"))
    call_ids: list[str] = field(default_factory=list)  # the calls' item ids, one per call

    @property
    def status(self) -> str:
        return {"length": "incomplete", "abort": "failed"}.get(self.finish_reason, "completed")

    @property
    def has_message(self) -> bool:
        return bool(self.text) or not self.calls

    def items(self) -> list[dict]:
        status = "incomplete" if self.status == "incomplete" else "completed"
        self.call_ids += [new_id("fc") for _ in self.calls[len(self.call_ids):]]
        message = [_message(self.message_id, self.text, status)] if self.has_message else []
        return message + [_function_call(i, c, status) for i, c in zip(self.call_ids, self.calls)]

    def chat_message(self) -> dict:
        """The answer as the conversation's next chat turn (a stored response's context).

        Only complete calls: a forced call cut short by ``max_output_tokens`` has arguments that
        are not JSON, which the chat conversion rightly refuses in a conversation, so a stored turn
        carrying it would make every continuation (``previous_response_id``) a 400 that blames the
        client. Why not its text as the turn's content instead: that text is the arguments' start,
        not what the model wrote (the grammar's ``{"name": ..., "arguments": ...`` wrapper is gone),
        and a turn of raw JSON would prompt the model to answer the next turn with JSON as text. So
        the cut-off call is left out, as if the turn had stopped before it: the client, told
        ``incomplete``, continues with a new message or a larger ``max_output_tokens``.
        """
        calls = [c for c in self.calls if self.status != "incomplete" or _is_complete(c)]
        message: dict = {"role": "assistant", "content": self.text or (None if calls else "")}
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                  "arguments": c.arguments}}
                                     for c in calls]
        return message


@dataclass
class Draft:
    """The response's own fields, echoed from its request."""

    id: str
    model: str
    body: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def json(self, status: str, output: Output | None = None) -> dict:
        body = self.body
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        done = output is not None and status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": ({"code": "server_error", "message": "the backend dropped the request"}
                                           if status == "failed" else None),
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output.items() if done else [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": text_format}, "tool_choice": body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "truncation": body.truncation or "disabled", "user": body.user, "metadata": body.metadata or {},
            "usage": usage_json(output.usage) if done else None,
        }


class _Events:
    """Numbers the events of one stream."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: object) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _opened(event: _Events, message_id: str) -> list[str]:
    """The events that open the message item and its one text part."""
    return [event("response.output_item.added", output_index=0, item=_message(message_id, None, "in_progress")),
            event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                  part=_text_part(""))]


async def events(draft: Draft, first: Delta, rest: AsyncIterator[Delta], error_body: Callable[[BaseException], dict],
                 on_done: Callable[[dict, Output], Awaitable[None]]) -> AsyncIterator[str]:
    """The SSE stream of a response whose first piece has arrived (so its status is 200).

    Args:
        error_body: the OpenAI error object of a failure after the first piece.
        on_done: awaited with the final response and its output before ``response.completed`` goes out
            (it may change the response: ``store`` false when it could not be stored).
    """
    event, out = _Events(), Output()
    yield event("response.created", response=draft.json("in_progress"))
    yield event("response.in_progress", response=draft.json("in_progress"))
    ids = {"item_id": out.message_id, "output_index": 0}
    is_open = False
    try:
        async with contextlib.aclosing(rest):  # closing this stream (a client gone) closes the request
            piece: Delta | None = first
            while piece is not None:
                if piece.text and not is_open:
                    is_open = True
                    for text in _opened(event, out.message_id):
                        yield text
                if piece.text:
                    out.text += piece.text
                    yield event("response.output_text.delta", **ids, content_index=0, delta=piece.text, logprobs=[])
                out.calls += piece.tool_calls
                out.finish_reason = piece.finish_reason or out.finish_reason
                out.usage = piece.usage or out.usage
                piece = await anext(rest, None)
    except Exception as exc:  # sent as an error event (error_body logs bugs)
        error = error_body(exc)["error"]
        yield event("error", code=error["code"], message=error["message"], param=error["param"], error=error)
        return
    items = out.items()
    if out.has_message:
        if not is_open:
            for text in _opened(event, out.message_id):
                yield text
        yield event("response.output_text.done", **ids, content_index=0, text=out.text, logprobs=[])
        yield event("response.content_part.done", **ids, content_index=0, part=_text_part(out.text))
        yield event("response.output_item.done", output_index=0, item=items[0])
    first_call = int(out.has_message)
    for k, call in enumerate(out.calls):
        index, item = first_call + k, items[first_call + k]
        yield event("response.output_item.added", output_index=index,
                    item=_function_call(item["id"], call, "in_progress", arguments=""))
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=call.arguments)
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    name=call.name, arguments=call.arguments)
        yield event("response.output_item.done", output_index=index, item=item)
    final = draft.json(out.status, out)
    await on_done(final, out)
    yield event("response.completed", response=final)
