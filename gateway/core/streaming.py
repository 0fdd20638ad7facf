"""What a request's deltas become: a whole reply (within its size cap) or a stream (within its
write-stall timeout). Shared by both fronts, so each rule holds on both.

- ``collect``: a unary answer, one ``Completion`` per index; the ``ReplyBudget`` it is given
  refuses a reply that grows past the bytes one answer may carry (the backend request is aborted
  as the deltas are closed).
- ``pieces``: the stream a client sees, one piece whenever there is text, an end, usage or the
  prompt's logprobs; tokens whose text is not complete yet (half a UTF-8 character) wait for the
  next piece.
- ``send_within``: one write of a stream, given up after ``write_stall_timeout_s`` (a client that
  reads nothing holds a slot, a backend sequence and its KV blocks for nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from gateway.core.types import Completion, Delta, Reply, TokenLogprobs, Usage
from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument, ResourceExhaustedError


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7) if value >= 0 else 10


def logprobs_bytes(lp: TokenLogprobs) -> int:
    """The public ``TokenLogprobs`` message's size on the wire (proto3: zeros and empties left out)."""
    size = 0
    if lp.token_id:
        size += 1 + _varint_bytes(lp.token_id)
    if lp.logprob:
        size += 5
    if lp.top_token_ids:
        ids = sum(map(_varint_bytes, lp.top_token_ids))
        size += 1 + _varint_bytes(ids) + ids
    if lp.top_logprobs:
        values = 4 * len(lp.top_logprobs)
        size += 1 + _varint_bytes(values) + values
    if lp.rank:
        size += 1 + _varint_bytes(lp.rank)
    return size


def _entries_bytes(entries: list[TokenLogprobs]) -> int:
    return sum(size + 1 + _varint_bytes(size) for size in map(logprobs_bytes, entries))


# What one float of an embedding takes in an answer, by how the answer writes it: 4 bytes on the
# gRPC wire; in JSON, float32 values written as Python floats take up to 24 characters with their
# comma (-1.2345678901234567e-05,); base64 writes 4 bytes as 16/3 characters.
BYTES_PER_FLOAT = {"wire": 4.0, "float": 24.0, "base64": 16 / 3}


def delta_bytes(delta: Delta, prompt_copies: int = 1, bytes_per_float: float = BYTES_PER_FLOAT["wire"]) -> int:
    """What ``delta`` adds to a unary reply: its ids, text and logprobs entries as on the wire, the
    prompt's scores ``prompt_copies`` times (as often as the answer repeats them), and its embedding's
    floats at ``bytes_per_float`` each (``BYTES_PER_FLOAT`` of the answer's encoding)."""
    calls = sum(len(c.id) + len(c.name) + len(c.arguments.encode()) + 8 for c in delta.tool_calls)
    return (sum(map(_varint_bytes, delta.token_ids)) + len(delta.text.encode()) + _entries_bytes(delta.logprobs)
            + prompt_copies * _entries_bytes(delta.prompt_logprobs or []) + calls
            + math.ceil(bytes_per_float * len(delta.embedding or ())))


@dataclass
class ReplyBudget:
    """The bytes one unary answer may still carry (shared by the prompts of one HTTP answer).

    One measure for both fronts, the public gRPC reply's size: the limit a gRPC answer must fit,
    and the HTTP answer's bound (its JSON grows with the same ids, text and logprobs).
    ``prompt_copies``: how many times the answer carries a prompt's scores. A gRPC reply carries
    them once; an HTTP completion repeats them in every choice, twice with ``echo`` (its logprobs
    and ``prompt_logprobs``): counted once, 64 choices of a 1,315-token prompt's top-20 scores
    made a 162.6 MB body within a 4 MiB budget. ``bytes_per_float``: likewise an
    embedding's floats as the answer writes them (JSON takes about six times the wire's 4 bytes).
    """

    max_bytes: int
    used: int = 0
    hint: str = "use GenerateStream"
    prompt_copies: int = 1
    bytes_per_float: float = BYTES_PER_FLOAT["wire"]  # an embedding's, as the answer encodes it

    def check_prompt_scores(self, num_prompt_tokens: int, num_top: int) -> None:
        """Before the work: a prompt's scores, as many times as the answer carries them, must fit.

        Raises:
            InvalidArgument: they cannot (their smallest size on the wire is past what is left).
        """
        need = rules.min_reply_bytes(self.prompt_copies, num_prompt_tokens, num_top)
        if self.used + need > self.max_bytes:
            raise InvalidArgument(
                f"prompt_logprobs: the prompt's {num_prompt_tokens} tokens scored with {num_top} alternatives, "
                f"{self.prompt_copies} time(s) in the answer (once per choice, twice with echo), take at least "
                f"{need} bytes, more than the {self.max_bytes - self.used} one unary answer may still carry; "
                f"{self.hint}, or lower n or the logprobs")

    def spend(self, delta: Delta) -> None:
        self.used += delta_bytes(delta, self.prompt_copies, self.bytes_per_float)
        if self.used > self.max_bytes:
            raise ResourceExhaustedError(f"the reply has grown past the {self.max_bytes} bytes one unary reply "
                                         f"may carry; {self.hint}")


async def collect(request_id: str, deltas: AsyncIterator[Delta]) -> Reply:
    """The whole answer from a request's deltas: one Completion per index, in index order."""
    choices: dict[int, Completion] = {}
    usage = Usage()
    reply = Reply(request_id, [], usage)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            if delta.prompt_logprobs is not None:
                reply.prompt_logprobs, reply.prompt_token_ids = delta.prompt_logprobs, delta.prompt_token_ids
            reply.embedding = delta.embedding or reply.embedding
            choice = choices.get(delta.index)
            if choice is None:
                choice = choices[delta.index] = Completion(delta.index)
            choice.text += delta.text
            choice.token_ids += delta.token_ids
            choice.logprobs += delta.logprobs
            choice.tool_calls += delta.tool_calls
            if delta.finish_reason:
                choice.finish_reason, choice.stop_string = delta.finish_reason, delta.stop_string
            if delta.usage is not None:
                usage = delta.usage
    reply.choices, reply.usage = [choices[i] for i in sorted(choices)], usage
    return reply


@dataclass
class _Held:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


async def pieces(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The public stream: a piece whenever a completion has text, an end or usage.

    A piece carries every token id and logprob since the completion's previous piece.
    """
    held: dict[int, _Held] = {}
    # aclosing: a closed stream (a client gone) closes the backend call at once, not at garbage collection.
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            h = held.setdefault(delta.index, _Held())
            h.token_ids += delta.token_ids
            h.logprobs += delta.logprobs
            if not (delta.text or delta.finish_reason or delta.usage is not None or delta.prompt_logprobs is not None
                    or delta.embedding is not None):
                continue
            held[delta.index] = _Held()
            yield Delta(delta.index, delta.text, h.token_ids, h.logprobs, delta.finish_reason, delta.stop_string,
                        delta.usage, delta.tool_calls, delta.prompt_logprobs, delta.prompt_token_ids, delta.embedding)


async def send_within(write: Awaitable[None], timeout_s: float) -> bool:
    """Awaits one stream write; False when it did not complete within ``timeout_s`` (a stall).

    A write waits while the client's flow-control window (gRPC) or socket buffer (HTTP) is full.
    """
    try:
        async with asyncio.timeout(timeout_s):  # no task per write, unlike wait_for
            await write
    except TimeoutError:
        return False
    return True
