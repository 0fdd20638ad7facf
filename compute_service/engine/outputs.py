"""What the engine hands back (plain dataclasses, no protobuf).

Each step yields a ``RequestDelta`` per request that produced something: only what is new in that
step (tokens, text, logprobs) and, once, the finish. Why deltas and not the state so far: a stream
whose client reads slowly queues one output per step, and outputs that each carried every token
and logprob so far made its memory grow with the square of its length (n=32, 1000 tokens: 178 MB).
A delta is O(n * (1 + logprobs)) whatever the length. Callers that want the whole result
(``LLM.generate``) accumulate the deltas into a ``RequestOutput``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from compute_service.engine.sampler import TokenLogprobs


@dataclass
class CompletionDelta:
    """What one completion produced in one step.

    ``finish_reason`` is set in the one delta where the completion finished ("length", "stop",
    "eos", "abort", or "error" when something failed for this request alone, see ``error``).
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None  # parallel to token_ids, when the request asked for them
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass
class RequestDelta:
    """A request's news from one step; ``finished`` in its last one (every completion finished).

    ``prompt_token_ids`` is the request's own list (shared, never copied); ``error`` says what
    failed when the request ended with finish_reason "error".
    """

    request_id: str
    prompt_token_ids: list[int]
    completions: list[CompletionDelta] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0  # generated so far, over all completions (usage)
    finished: bool = False
    error: str | None = None
    # params.prompt_logprobs: prompt tokens 1..L-1 scored, in the one delta after the prompt was computed.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # params.pooling: the prompt's embedding (hidden_size floats, unit norm), in the request's last delta.
    embedding: list[float] | None = None



@dataclass
class CompletionOutput:
    """One completion of a finished request (``n`` > 1 gives several): all of it.

    ``text`` excludes the stop string that ended it.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "length", "stop", "eos", "abort", "error"
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked for them


@dataclass
class RequestOutput:
    """A request's result, accumulated from its deltas (``add``); ``finished`` once the last came."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1..L-1, when asked for
    embedding: list[float] | None = None  # with params.pooling

    def add(self, delta: RequestDelta) -> None:
        """Append one step's news (deltas of one request, in step order)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        for d in delta.completions:
            while len(self.outputs) <= d.index:  # completions are numbered 0..n-1; all share the params
                self.outputs.append(CompletionOutput(len(self.outputs), logprobs=None if d.logprobs is None else []))
            out = self.outputs[d.index]
            out.token_ids.extend(d.token_ids)
            out.text += d.text
            if d.logprobs is not None and out.logprobs is not None:
                out.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        self.num_cached_tokens = delta.num_cached_tokens
        self.finished = delta.finished
        self.error = delta.error or self.error

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated, summed over all completions."""
        return sum(len(c.token_ids) for c in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        """Token ids of the first completion (the only one unless n > 1)."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        """Text of the first completion."""
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def collect(results: dict[str, RequestOutput], deltas: Iterable[RequestDelta]) -> list[RequestOutput]:
    """Add each delta to its request's RequestOutput in ``results`` (made at its first delta).

    Returns:
        The requests that finished with these deltas.
    """
    finished = []
    for delta in deltas:
        out = results.get(delta.request_id)
        if out is None:
            out = results[delta.request_id] = RequestOutput(delta.request_id, delta.prompt_token_ids)
        out.add(delta)
        if out.finished:
            finished.append(out)
    return finished
