"""OpenAI response bodies and server-sent event streams from the gateway core's answers.

A request with several prompts (completions takes a list) runs as one public request per prompt;
its choices are numbered prompt-major (prompt ``p``'s sample ``j`` is choice ``p * n + j``), as
OpenAI and vLLM number them, and its usage is the sum.

Stream shape, as the official SDKs read it (and as vLLM's bugs taught): every chunk carries one
choice with its own ``index``; a chat choice's first chunk is ``{"role": "assistant", "content":
""}``; ``finish_reason`` is set once per index; chunks with nothing new are skipped; ``usage`` is
sent only when ``stream_options.include_usage`` is true, then as ``null`` on every chunk and once,
with the totals, in a final chunk with ``choices: []``; the stream ends with ``data: [DONE]``. An
error after the first chunk is a chunk with a top-level ``"error"`` (the SDK raises on it).
A chat completion's tool calls (``gateway.core.tools``) are ``message.tool_calls`` (content null
when there is none besides them), streamed whole as ``delta.tool_calls`` in its last chunk.

Prompt scores: a completion with ``echo`` starts with the prompt's text (a stream: in each choice's
first chunk) and, with ``logprobs``, its logprobs start with the prompt's tokens (the first with a
null logprob); vLLM's ``prompt_logprobs`` is each completions choice's ``prompt_logprobs`` and a chat
answer's top-level one (whole answers only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway.openai_api import convert
from gateway.core.types import Completion, Delta, Reply, TokenLogprobs, Usage


@dataclass
class Answer:
    """What every chunk and body of one HTTP request shares."""

    id: str
    model: str
    endpoint: str  # "completions" or "chat"
    n: int
    logprobs: bool
    decode: Callable[[int], str]
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Completions' echo: per prompt, its text, or its token ids (decoded with ``decode_text``).
    echo: list[str | list[int]] | None = None
    decode_text: Callable[[list[int]], str] | None = None
    num_top: int = 0  # logprobs' alternatives per token (the echoed prompt's too)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for

    def echo_text(self, prompt: int) -> str:
        given = self.echo[prompt] if self.echo else ""
        return given if isinstance(given, str) else self.decode_text(given)  # type: ignore[misc]

    def _echo_logprobs(self, reply: Reply | Delta) -> dict:
        """The echoed prompt's part of a completion's logprobs (it needs the prompt's scores)."""
        return convert.echo_logprobs(reply.prompt_token_ids or [], reply.prompt_logprobs or [], self.num_top,
                                     self.decode)

    def _completion_logprobs(self, reply: Reply, c: Completion) -> dict | None:
        if not self.logprobs or not self.echo:
            return self._logprobs(c.logprobs)
        prompt = self._echo_logprobs(reply)
        offset = prompt["text_offset"][-1] + len(prompt["tokens"][-1]) if prompt["tokens"] else 0
        generated = convert.completion_logprobs(c.logprobs, self.decode, offset)
        return {key: prompt[key] + generated[key] for key in prompt}

    def _logprobs(self, items: list[TokenLogprobs], offset: int = 0) -> dict | None:
        if not self.logprobs:
            return None
        if self.endpoint == "chat":
            return convert.chat_logprobs(items, self.decode)
        return convert.completion_logprobs(items, self.decode, offset)

    def body(self, replies: list[Reply]) -> dict:
        """The whole (non-streamed) response body."""
        choices = []
        for p, reply in enumerate(replies):
            for c in reply.choices:
                choice: dict = {"index": p * self.n + c.index, "finish_reason": convert.finish_reason(c.finish_reason)}
                if self.endpoint == "chat":
                    choice["logprobs"] = self._logprobs(c.logprobs)
                else:
                    choice["logprobs"] = self._completion_logprobs(reply, c)
                    if self.prompt_logprobs:
                        choice["prompt_logprobs"] = convert.vllm_prompt_logprobs(reply.prompt_logprobs or [],
                                                                                 self.decode)
                if self.endpoint == "chat":
                    choice["message"] = {"role": "assistant", "content": c.text}
                    if c.tool_calls:
                        choice["message"] = {"role": "assistant", "content": c.text or None,
                                             "tool_calls": [convert.tool_call_json(t) for t in c.tool_calls]}
                else:
                    choice["text"] = self.echo_text(p) + c.text if self.echo else c.text
                choices.append(choice)
        obj = "chat.completion" if self.endpoint == "chat" else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": sorted(choices, key=lambda c: c["index"]),
                "usage": convert.usage([r.usage for r in replies])}
        if self.endpoint == "chat" and self.prompt_logprobs:
            body["prompt_logprobs"] = convert.vllm_prompt_logprobs(replies[0].prompt_logprobs or [], self.decode)
        return body

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        data: dict = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            data["usage"] = usage
        return sse(data)


def sse(data: dict | str) -> str:
    """One server-sent event carrying ``data`` (a JSON object, or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def events(answer: Answer, first: tuple[int, Delta], rest: AsyncIterator[tuple[int, Delta]],
                 error_body: Callable[[BaseException], dict]) -> AsyncIterator[str]:
    """The SSE stream of a request whose first piece has arrived (so its status is 200).

    Args:
        first: (prompt number, piece), the first piece of any prompt.
        rest: the following pieces of every prompt.
        error_body: the OpenAI error object of a failure after the first piece.
    """
    started: set[int] = set()
    offsets: dict[int, int] = {}
    usages: dict[int, Usage] = {}
    scores: dict[int, Delta] = {}  # per prompt, the piece with its scores (echo with logprobs)

    def render(prompt: int, piece: Delta) -> list[str]:
        index = prompt * answer.n + piece.index
        out = []
        if piece.prompt_token_ids is not None:
            scores[prompt] = piece
        if answer.echo and index not in started:  # the prompt leads each completion
            started.add(index)
            echo: dict = {"index": index, "text": answer.echo_text(prompt), "logprobs": None, "finish_reason": None}
            if answer.logprobs:
                echo["logprobs"] = answer._echo_logprobs(scores[prompt])
                tokens = echo["logprobs"]["tokens"]
                offsets[index] = echo["logprobs"]["text_offset"][-1] + len(tokens[-1]) if tokens else 0
            out.append(answer.chunk([echo]))
        if answer.endpoint == "chat" and index not in started:
            started.add(index)
            out.append(answer.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]))
        reason = convert.finish_reason(piece.finish_reason)
        if piece.text or piece.logprobs or reason:
            choice: dict = {"index": index, "logprobs": answer._logprobs(piece.logprobs, offsets.get(index, 0)),
                            "finish_reason": reason}
            if answer.endpoint == "chat":
                choice["delta"] = {"content": piece.text} if piece.text else {}
                if piece.tool_calls:  # a completion's calls, whole, in its last chunk
                    choice["delta"]["tool_calls"] = [{"index": k, **convert.tool_call_json(call)}
                                                     for k, call in enumerate(piece.tool_calls)]
            else:
                choice["text"] = piece.text
            offsets[index] = offsets.get(index, 0) + len(piece.text)
            out.append(answer.chunk([choice]))
        if piece.usage is not None:
            usages[prompt] = piece.usage
        return out

    for text in render(*first):
        yield text
    try:
        async with contextlib.aclosing(rest):  # closing this stream (a client gone) closes the requests
            async for prompt, piece in rest:
                for text in render(prompt, piece):
                    yield text
    except Exception as exc:  # sent as an error chunk (error_body logs bugs)
        yield sse(error_body(exc))
        yield sse("[DONE]")
        return
    if answer.include_usage:
        yield answer.chunk([], convert.usage([usages[p] for p in sorted(usages)]))
    yield sse("[DONE]")


async def merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Pieces of several prompts' streams as they come, tagged with the prompt's number.

    One stream is passed through as it is; several run as tasks feeding a queue, and closing the
    merged stream (a client that went away) cancels them all, which aborts their requests.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for piece in only:
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(number: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for piece in stream:
                    await queue.put((number, piece))
            await queue.put((number, done))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((number, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            number, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield number, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
