"""What the engine hands back per request (plain dataclasses, no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

from compute_service.engine.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    """One completion of a request (``n`` > 1 gives several): its state so far, and what is new
    since the previous step's output (what a stream sends).

    ``text`` is the text settled so far (the full text once finished, the stop string excluded);
    the ``new_text`` pieces of all steps concatenate to it.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "length", "stop", "eos", "abort", or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked for them
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs] | None = None
    is_new_finish: bool = False  # finished in this step

    @property
    def has_news(self) -> bool:
        """Something to stream: new tokens, new text, or the finish."""
        return bool(self.new_token_ids or self.new_text or self.is_new_finish)


@dataclass
class RequestOutput:
    """A request's state after a step; ``finished`` once every completion has a finish reason."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False

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
