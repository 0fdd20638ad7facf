"""A request as the engine tracks it: its sequences, and per completion what is new since its last delta.

The scheduler sees sequences only; everything a caller reads back (text, stop reasons, logprobs,
what is new since the last output) lives here, so that the engine loop stays three lines.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument

from compute_service.engine.detokenizer import IncrementalDetokenizer
from compute_service.engine.outputs import CompletionDelta, RequestDelta
from compute_service.engine.sampler import TokenLogprobs
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import FinishReason, Sequence
from compute_service.model.model_config import ModelConfig


@dataclass(frozen=True)
class GenerateInput:
    """A new request's fields, in one object from the edge (the servicer's ``convert``, or
    ``Engine.add_request``'s arguments) through the engine loop to the engine, which checks it
    (``Engine.check_request``) and tracks it as a ``Request``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""
    tenant: str = ""  # who it is for: admission is fair between tenants (scheduler.py)


def check_input(request: GenerateInput, model_config: ModelConfig, has_tokenizer: bool, block_size: int,
                num_general_blocks: int) -> None:
    """Raise InvalidArgument (naming the field) unless ``request`` can run on this model and pool
    (``Engine.check_request``: a pure function of constants, so any thread may call it).

    Lengths before contents: the prompt's length is compared with the model's before any id is
    read, and the ids are then checked in one pass (``check_token_ids``).

    Args:
        model_config: the model's (its length and vocabulary); has_tokenizer: whether it has one.
        block_size, num_general_blocks: the KV pool's (blocks of any priority).
    """
    request_id, prompt_token_ids, params = request.request_id, request.prompt_token_ids, request.params
    rules.check_ids(request_id, request.cache_salt)
    rules.check_string_id("tenant", request.tenant, rules.MAX_TENANT_CHARS)
    rules.check_prompt_length(len(prompt_token_ids), params.max_tokens, model_config.max_position)
    vocab = model_config.vocab_size
    rules.check_token_ids("prompt_token_ids", prompt_token_ids, vocab)
    rules.check_token_ids("params.stop_token_ids", params.stop_token_ids, vocab)
    rules.check_logit_bias(params.logit_bias, vocab_size=vocab)
    if params.stop and not has_tokenizer:
        raise InvalidArgument("params.stop: this model has no tokenizer, so stop strings cannot match; "
                              "use stop_token_ids")
    if params.constraint is not None and not has_tokenizer:
        raise InvalidArgument(f"params.{params.constraint.kind}: this model has no tokenizer, "
                              "so no grammar can be compiled")
    # Rejected up front: waiting for blocks that can never be free at once would starve it
    # (or preempt its own completions) forever. n completions hold n copies of max_tokens.
    rules.check_capacity(len(prompt_token_ids), params.max_tokens, params.n, block_size, num_general_blocks)


@dataclass(frozen=True)
class TenantQueue:
    """One tenant's requests in the engine (the per-tenant queue gauges)."""

    tenant: str
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class EngineLoad:
    """What a router needs to know about an engine's load (see the Load RPC)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_hit_rate: float
    num_pending_tokens: int
    tenants: tuple[TenantQueue, ...] = ()  # the tenants with requests in the engine, by name

    @classmethod
    def of(cls, running: list[Sequence], waiting: list[Sequence], kv_usage: float,
           prefix_cache_hit_rate: float) -> EngineLoad:
        """The load of an engine whose scheduler holds ``running`` and ``waiting``: requests (a
        request with completions in both counts as running), outstanding tokens, tenants."""
        running_ids = {s.request_id for s in running}
        num_pending = sum((s.num_tokens - s.num_computed_tokens) + (s.params.max_tokens - s.num_output_tokens)
                          for s in itertools.chain(running, waiting))
        tenants: dict[str, tuple[set[str], set[str]]] = {}  # tenant -> (running, waiting) request ids
        for i, seqs in enumerate((running, waiting)):
            for s in seqs:
                tenants.setdefault(s.tenant, (set(), set()))[i].add(s.request_id)
        return cls(
            num_running=len(running_ids),
            num_waiting=len({s.request_id for s in waiting} - running_ids),
            kv_usage=kv_usage,
            prefix_cache_hit_rate=prefix_cache_hit_rate,
            num_pending_tokens=num_pending,
            tenants=tuple(TenantQueue(name, len(run), len(wait - run))
                          for name, (run, wait) in sorted(tenants.items())),
        )


@dataclass
class Completion:
    """Caller-facing state of one completion: what it produced since its last delta.

    Only the news is kept (``new_logprobs``, the token count already reported): the engine never
    holds a second copy of what it already handed out.
    """

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # since the last delta
    stop_reason: str | int | None = None
    num_reported_tokens: int = 0
    is_finish_reported: bool = False

    @property
    def has_news(self) -> bool:
        seq = self.seq
        return seq.num_output_tokens > self.num_reported_tokens or seq.is_finished != self.is_finish_reported

    def next_text(self) -> str:
        """The text piece of the next delta (a failed completion's detokenizer is not called again)."""
        if self.seq.finish_reason is FinishReason.ERROR:
            return ""
        return self.detokenizer.next_piece(self.seq.is_finished)

    def delta(self, text: str) -> CompletionDelta:
        """What is new since the previous call, with ``text`` from ``next_text`` (never raises)."""
        seq = self.seq
        failed = seq.finish_reason is FinishReason.ERROR
        start, self.num_reported_tokens = self.num_reported_tokens, seq.num_output_tokens
        is_new_finish = seq.is_finished and not self.is_finish_reported
        self.is_finish_reported = seq.is_finished
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, self.new_logprobs = ([] if failed else self.new_logprobs), []
        return CompletionDelta(
            index=seq.index,
            # A failed completion's last tokens were never detokenized: they are not handed out.
            token_ids=[] if failed else seq.output_token_ids[start:],
            text=text,
            logprobs=logprobs,
            finish_reason=seq.finish_reason.value if is_new_finish else None,
            stop_reason=self.stop_reason if is_new_finish else None,
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
    tenant: str = ""
    grammar: Any | None = None  # params.constraint compiled (xgrammar CompiledGrammar); each completion its own matcher
    completions: dict[int, Completion] = field(default_factory=dict)  # by completion index
    is_paused: bool = False  # its consumer's buffer is full: not scheduled until resumed
    error: str | None = None  # what failed, when it ended with finish_reason "error"
    # params.prompt_logprobs: the prompt tokens scored so far (1..), handed out once all are.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    is_prompt_logprobs_reported: bool = False

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions.values()]

    def add_seq(self, seq: Sequence, detokenizer: IncrementalDetokenizer | None = None) -> None:
        seq.is_paused = self.is_paused
        self.completions[seq.index] = Completion(
            seq, detokenizer or IncrementalDetokenizer(self.tokenizer, self.params.stop))

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        ended_early = any(s.finish_reason in (FinishReason.ABORT, FinishReason.ERROR) for s in seqs)
        return all(s.is_finished for s in seqs) and (ended_early or len(seqs) == self.params.n)

    def fail(self, error: str) -> list[Sequence]:
        """End every completion with finish_reason "error"; ``error`` says what failed (the first
        failure's stands). A completion whose finish was already reported keeps it.

        Returns:
            The sequences that had not finished: the caller frees them in the scheduler.
        """
        if self.error is None:
            self.error = error
        unfinished = []
        for completion in self.completions.values():
            seq = completion.seq
            if completion.is_finish_reported:
                continue  # its finish already went out: it stands
            if not seq.is_finished:
                unfinished.append(seq)
            seq.fail()
        return unfinished

    def delta(self) -> RequestDelta:
        """The request's news since the previous call: one entry per completion that has some."""
        news = [c for _, c in sorted(self.completions.items()) if c.has_news]
        # Every text piece first: if a detokenizer raises, no completion has marked anything reported.
        texts = [c.next_text() for c in news]
        completions = [c.delta(text) for c, text in zip(news, texts)]
        prompt_logprobs = None
        if (self.params.prompt_logprobs is not None and not self.is_prompt_logprobs_reported
                and len(self.prompt_logprobs) == len(self.prompt_token_ids) - 1):
            prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, []
            self.is_prompt_logprobs_reported = True
        finished = self.is_finished
        embedding = self._embedding() if finished else None
        return RequestDelta(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            completions=completions,
            num_cached_tokens=self.completions[0].seq.num_cached_tokens,
            num_completion_tokens=sum(c.seq.num_output_tokens for c in self.completions.values()),
            finished=finished,
            error=self.error,
            prompt_logprobs=prompt_logprobs,
            embedding=embedding,
        )

    def _embedding(self) -> list[float] | None:
        """The pooled prompt, L2-normalized (vLLM's embedding pooler), once every position it takes is in."""
        seq = self.completions[0].seq if 0 in self.completions else None
        if self.params.pooling is None or seq is None or seq.pooled is None or seq.needs_pooling:
            return None
        pooled = seq.pooled / (len(self.prompt_token_ids) if self.params.pooling == "mean" else 1)
        return (pooled / pooled.norm().clamp_min(1e-12)).tolist()
