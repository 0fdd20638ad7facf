"""A request as the engine tracks it: its sequences, and per completion the text and logprobs so far.

The scheduler sees sequences only; everything a caller reads back (text, stop reasons, logprobs,
what is new since the last output) lives here, so that the engine loop stays three lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compute_service.engine.detokenizer import IncrementalDetokenizer
from compute_service.engine.outputs import CompletionOutput, RequestOutput
from compute_service.engine.sampler import TokenLogprobs
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class EngineLoad:
    """What a router needs to know about an engine's load (see the Load RPC)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_hit_rate: float
    num_pending_tokens: int


@dataclass
class Completion:
    """Caller-facing state of one completion; ``num_reported_*`` count what earlier outputs carried."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: str | int | None = None
    num_reported_tokens: int = 0
    is_finish_reported: bool = False

    def output(self) -> CompletionOutput:
        """This completion now, with what is new since the previous call."""
        seq = self.seq
        start = self.num_reported_tokens
        self.num_reported_tokens = seq.num_output_tokens
        is_new_finish = seq.is_finished and not self.is_finish_reported
        self.is_finish_reported = seq.is_finished
        asked_logprobs = seq.params.logprobs is not None
        return CompletionOutput(
            index=seq.index,
            token_ids=list(seq.output_token_ids),
            new_text=self.detokenizer.next_piece(seq.is_finished),
            text=self.detokenizer.emitted_text,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if asked_logprobs else None,
            new_token_ids=seq.output_token_ids[start:],
            new_logprobs=self.logprobs[start:] if asked_logprobs else None,
            is_new_finish=is_new_finish,
        )


@dataclass
class Request:
    """One request: ``n`` completions of the same prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Any | None
    priority: int = 0
    cache_salt: str = ""
    completions: dict[int, Completion] = field(default_factory=dict)  # by completion index

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions.values()]

    def add_seq(self, seq: Sequence) -> None:
        self.completions[seq.index] = Completion(seq, IncrementalDetokenizer(self.tokenizer, self.params.stop))

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        aborted = any(s.finish_reason == FinishReason.ABORT for s in seqs)
        return all(s.is_finished for s in seqs) and (aborted or len(seqs) == self.params.n)

    def output(self) -> RequestOutput:
        """The request's state; each completion says what is new since the previous output."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.completions[i].output() for i in sorted(self.completions)],
            num_cached_tokens=self.completions[0].seq.num_cached_tokens,
            finished=self.is_finished,
        )
