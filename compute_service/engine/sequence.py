"""Request state as counters with invariants; everything else is derived.

Invariants: ``num_cached_tokens <= num_computed_tokens <= num_tokens``; the K/V of the first
``num_computed_tokens`` tokens is in the pool at the positions given by ``block_table``; the memory
service's view of the sequence holds those tokens but the last ``num_unappended_tokens`` (accepted
speculative drafts, see speculative.py: they are sent with the next step's append), plus the ones
scheduled this step.

The counters, the block table and the finish reason change only through the transitions below
(``admit``, ``extend_blocks``, ``advance``, ``append_token``, ``accept_drafts``, ``fork``, ``finish``,
``fail``, ``reset_for_recompute``), each of which keeps the invariants; the scheduler and the engine call
them rather than writing the fields.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from compute_service.engine.sampling_params import SamplingParams

_arrival = itertools.count()


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    ABORT = "abort"
    ERROR = "error"  # a failure of this request alone (its sampling, detokenizing, stop checks)


@dataclass(eq=False)
class Sequence:
    """One generation stream (a request with n > 1 has n of them).

    ``seq_id`` is unique per engine; ``arrival`` orders equal priorities first come, first served.
    """

    seq_id: str
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_namespace: str = ""
    tenant: str = ""  # its request's tenant: the scheduler admits fairly between tenants
    index: int = 0  # which completion of its request
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at (the last) admission
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival))
    generator: torch.Generator | None = None
    is_paused: bool = False  # its request's consumer is not keeping up: keep the blocks, skip the steps
    # Waiting for the memory service to load its cached prefix from a tier (memory.proto's
    # OpResult.loading): not admitted again until the service reports the load over.
    is_loading: bool = False
    # The memory service answered its AllocateOp ``loading`` since its last admission: it remembers the
    # seq_id until an AllocateOp of it gets blocks, so dropping it (an abort) sends a FreeOp of it.
    has_tier_load: bool = False
    # xgrammar GrammarMatcher of a constrained completion: it has accepted exactly output_token_ids
    # (advanced once per sampled token; recompute after preemption leaves it alone).
    matcher: Any | None = None
    # Tokens whose K/V is computed but which the memory service has not been sent yet: accepted
    # drafts, and decode tokens of steps that needed no memory-service call (scheduler.py, rule 7).
    num_unappended_tokens: int = 0
    # Its last block is shared with a fork (parent or child) until its next append reaches the memory
    # service, which copies the block on write: that append cannot be deferred.
    is_last_block_shared: bool = False
    ngrams: Any | None = None  # speculative.NgramIndex, made on its first proposal
    # Prompt logprobs (params.prompt_logprobs): prompt tokens 1..num_prompt_logprobs are scored
    # (the logits at positions 0..num_prompt_logprobs - 1 were computed and reduced).
    num_prompt_logprobs: int = 0
    # Pooling (params.pooling, an embedding): the final normed hidden states of the prompt positions
    # before num_pooled that the pooling takes ("last": only the last), summed: (hidden,) float32.
    num_pooled: int = 0
    pooled: torch.Tensor | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens are still to be scored: every prompt position must be computed by the
        model (no prefix-cache hit may skip one). Only the first completion scores the prompt: the
        others fork from it once the prompt is done."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1)

    def prompt_logprob_targets(self, num_new_tokens: int) -> range:
        """The prompt tokens scored by this step's ``num_new_tokens`` (from ``num_computed_tokens``):
        token t is scored by the logits at position t - 1, so a chunk over positions [c, c + k)
        scores tokens c + 1 .. c + k, up to the prompt's last, and none scored before (a recompute
        after preemption scores nothing twice)."""
        if not self.needs_prompt_logprobs:
            return range(0)
        start = max(self.num_computed_tokens, self.num_prompt_logprobs) + 1
        return range(start, min(self.num_computed_tokens + num_new_tokens, len(self.prompt_token_ids) - 1) + 1)

    def add_prompt_logprobs(self, num: int) -> None:
        """``num`` more prompt tokens were scored (``prompt_logprob_targets``' range, in order)."""
        assert self.num_prompt_logprobs + num <= len(self.prompt_token_ids) - 1
        self.num_prompt_logprobs += num

    @property
    def needs_pooling(self) -> bool:
        """Prompt positions are still to be pooled: each must be computed (as for prompt logprobs)."""
        return self.params.pooling is not None and self.index == 0 and self.num_pooled < len(self.prompt_token_ids)

    @property
    def needs_every_position(self) -> bool:
        """Its admission may read no prefix cache: prompt logprobs score every position, and "mean"
        pooling averages them. "last" pooling takes only the last prompt position, which is always
        computed (a cache hit leaves at least the prompt's last token to compute), so it may."""
        return self.needs_prompt_logprobs or (self.needs_pooling and self.params.pooling == "mean")

    def pooling_targets(self, num_new_tokens: int) -> range:
        """The prompt positions this step's ``num_new_tokens`` computes that the pooling takes: all
        of them for "mean", the prompt's last for "last"; none pooled before (a recompute after
        preemption pools nothing twice)."""
        if not self.needs_pooling:
            return range(0)
        num_prompt = len(self.prompt_token_ids)
        start = max(self.num_computed_tokens, self.num_pooled)
        if self.params.pooling == "last":
            start = max(start, num_prompt - 1)
        return range(start, max(start, min(self.num_computed_tokens + num_new_tokens, num_prompt)))

    def add_pooled(self, summed: torch.Tensor, target: range) -> None:
        """The hidden states of ``target`` (``pooling_targets``' range), summed, (hidden,) float32."""
        assert target.start >= self.num_pooled and target.stop <= len(self.prompt_token_ids)
        self.pooled = summed if self.pooled is None else self.pooled + summed
        self.num_pooled = target.stop

    def tokens_to_compute(self, n: int) -> list[int]:
        """The next ``n`` tokens whose K/V is not in the pool yet."""
        return self._tokens_from(self.num_computed_tokens, n)

    def tokens_to_append(self, n: int) -> list[int]:
        """What this step's append sends the memory service: the accepted drafts it has not been
        sent yet, then the next ``n`` tokens to compute."""
        return self._tokens_from(self.num_computed_tokens - self.num_unappended_tokens, n + self.num_unappended_tokens)

    def _tokens_from(self, start: int, n: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if start + n <= prompt_len:
            return self.prompt_token_ids[start : start + n]
        if start >= prompt_len:  # decode (or recompute past the prompt): no concatenation per step
            return self.output_token_ids[start - prompt_len : start - prompt_len + n]
        return self.token_ids[start : start + n]

    # --- transitions ----------------------------------------------------------------------

    def admit(self, block_ids: list[int], num_cached_tokens: int) -> None:
        """Admitted by the memory service: ``block_ids`` hold its tokens so far, the first
        ``num_cached_tokens`` of them already computed (prefix-cache hits)."""
        assert self.num_computed_tokens == 0 and not self.block_table, "admitted twice"
        assert 0 <= num_cached_tokens <= self.num_tokens
        self.block_table = list(block_ids)
        self.num_cached_tokens = self.num_computed_tokens = num_cached_tokens

    def extend_blocks(self, block_ids: list[int], copies: list[tuple[int, int]]) -> None:
        """An append's answer: new blocks at the end, and copy-on-write replacements (src -> dst).
        The append carried the unappended tokens too."""
        self.num_unappended_tokens = 0
        self.is_last_block_shared = False
        self.block_table.extend(block_ids)
        for src, dst in copies:
            self.block_table[self.block_table.index(src)] = dst

    def advance(self, num_new_tokens: int, *, is_appended: bool = True) -> bool:
        """The K/V of ``num_new_tokens`` more tokens was computed; True when every token's is (the
        prompt is done, or a decode step ran): the moment to sample. ``is_appended``: False when the
        step did not tell the memory service about them (they go with the next append)."""
        self.num_computed_tokens += num_new_tokens
        if not is_appended:
            self.num_unappended_tokens += num_new_tokens
        assert self.num_computed_tokens <= self.num_tokens, "computed more tokens than it has"
        return self.num_computed_tokens == self.num_tokens

    def append_token(self, token_id: int) -> None:
        """A sampled token (its K/V is computed by the next step)."""
        assert not self.is_finished, "a token after the finish"
        self.output_token_ids.append(token_id)

    def accept_drafts(self, num_accepted: int) -> None:
        """``num_accepted`` drafts computed this step were accepted (they are appended as output
        tokens already): their K/V is in the pool; the memory service learns of them next step."""
        assert 0 <= num_accepted and self.num_computed_tokens + num_accepted < self.num_tokens
        self.num_computed_tokens += num_accepted
        self.num_unappended_tokens += num_accepted

    def fork(self, child: Sequence) -> None:
        """``child`` (a fresh sequence of the same prompt) shares this one's computed tokens and
        blocks (the memory service forks them copy-on-write)."""
        assert child.num_computed_tokens == 0 and not child.block_table and not child.output_token_ids
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_table = list(self.block_table)
        child.num_unappended_tokens = self.num_unappended_tokens  # the ForkOp forks the service's view
        self.is_last_block_shared = child.is_last_block_shared = True

    def finish(self, reason: FinishReason) -> None:
        assert not self.is_finished, f"finished twice ({self.finish_reason} then {reason})"
        self.finish_reason = reason

    def fail(self) -> None:
        """Its request failed: ends with ERROR, replacing a finish that no output reported yet."""
        self.finish_reason = FinishReason.ERROR

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; everything (prompt and output so far) is recomputed."""
        self.num_computed_tokens = 0
        self.num_unappended_tokens = 0
        self.is_last_block_shared = False
        self.block_table = []
        self.num_preemptions += 1
