"""What the engine hands back per request (plain dataclasses, no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request (``n`` > 1 gives several)."""

    index: int
    token_ids: list[int]
    text: str  # filled when the completion finishes ("" before)
    finish_reason: str | None  # "length", "stop", "eos", "abort", or None while running


@dataclass
class RequestOutput:
    """A request's state after a step; ``finished`` once every completion has a finish reason."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False

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
