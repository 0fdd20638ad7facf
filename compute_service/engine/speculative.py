"""N-gram speculative decoding (prompt lookup) for greedy sequences.

A decoding sequence whose last few tokens already occurred earlier in its prompt or output often
goes on the way it went then (quoted text, code, lists, and the loops small models fall into).
The proposer looks up the longest suffix of 4 down to 1 tokens at its latest earlier occurrence
and drafts the k tokens that followed it (going around the loop when that occurrence is fewer than
k tokens back: 13 of 129 steps fewer on bench_throughput's workload). The step then computes the
sequence's last token and its drafts together (q_len = 1 + k, like a prompt chunk over cached
context); the logits after each row give the greedy token there, so the drafts are checked in the
same forward:

    greedy[0] = argmax(after the last token), greedy[i] = argmax(after draft i)
    a = the number of leading drafts equal to greedy[0..a-1]
    emitted: greedy[0 .. a] (the accepted drafts, and one token more)

Those are the tokens plain greedy decoding produces, one per step, up to floating-point differences
between the kernels that score one new token and those that score a chunk (a near-tie argmax could
flip in bfloat16 on a GPU; the float32 CPU tests see identical tokens); a step emits 1 to k + 1
tokens for the cost of k more rows of the same forward. That pays
where a step is bound by reading the weights and the KV cache (every batch size on a CPU up to a
few dozen sequences), so the row budget for drafts shrinks as the batch grows
(``draft_budget``), and only greedy, plain sequences take part (see ``eligible``).

Memory-service bookkeeping: drafts are written into free slots of the sequence's last block only
(a draft never needs a new block), and the memory service is not told about them. Accepted drafts
are appended to the memory service with the next step's token (``Sequence.num_unappended_tokens``),
so its view of the sequence, and its prefix-cache hashes, only ever hold accepted tokens; a
rejected draft's slot is past the sequence's length and is overwritten by the real token later.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compute_service.engine.sampler import greedy_tokens
from compute_service.engine.scheduler import ScheduledSeq
from compute_service.engine.sequence import Sequence

MAX_NGRAM = 4
MIN_NGRAM = 1
# Draft rows per step, across the batch: a decode step's weights and KV are read once whatever
# the number of rows, until the rows make it compute-bound (about a hundred rows for SmolLM2-135M
# on a 2-core AVX-512 CPU).
DRAFT_ROWS_PER_STEP = 96


class NgramIndex:
    """The latest position that followed each n-gram (n = MIN_NGRAM..MAX_NGRAM) of one sequence,
    kept up to date incrementally: a proposal costs O(new tokens), not O(context), after the first,
    which indexes the whole prompt."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self._num_indexed = 0  # n-grams ending before this position are in the tables

    def _sync(self, seq: Sequence) -> None:
        tokens = self._tokens
        if not tokens:
            tokens.extend(seq.prompt_token_ids)
        num_outputs = len(tokens) - seq.num_prompt_tokens
        tokens.extend(seq.output_token_ids[num_outputs:])
        # Every n-gram that has a following token (all but those ending at the last position).
        for end in range(self._num_indexed, len(tokens) - 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                self._follow[n][tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self._num_indexed = max(self._num_indexed, len(tokens) - 1)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the sequence's suffix.

        An occurrence less than ``k`` tokens back means the sequence is in a loop of that period
        (``a b a b``: the suffix ``a b`` last occurred 2 back, followed by ``a b`` and then the end):
        the drafts go on around the loop rather than stopping at the end of the sequence.
        """
        self._sync(seq)
        tokens = self._tokens
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            start = self._follow[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                period = len(tokens) - start
                return [tokens[start + i % period] for i in range(k)]
        return []


def eligible(seq: Sequence) -> bool:
    """Whether the sequence's next tokens are plain argmaxes that drafts can be checked against:
    greedy, no penalties or min_tokens (they depend on the tokens before), no logprobs, a single
    completion (forked sequences share their last block), no grammar, no logit_bias (draft rows are
    plain argmaxes of the raw logits)."""
    p = seq.params
    return (p.is_greedy and not p.has_penalties and seq.num_output_tokens >= p.min_tokens and p.n == 1
            and p.logprobs is None and seq.matcher is None and not p.logit_bias and seq.num_output_tokens > 0)


def draft_budget(num_decodes: int, max_per_seq: int) -> int:
    """Drafts each decoding sequence may take this step."""
    if num_decodes <= 0:
        return 0
    return max(0, min(max_per_seq, DRAFT_ROWS_PER_STEP // num_decodes))


def room_for_drafts(seq: Sequence, block_size: int, max_position: int) -> int:
    """Drafts that fit after the sequence's last token: in its last block (no new block), within
    max_tokens (leaving the token that follows the last accepted draft) and the model's length."""
    in_block = len(seq.block_table) * block_size - seq.num_tokens
    left = seq.params.max_tokens - seq.num_output_tokens - 1
    return max(0, min(in_block, left, max_position - seq.num_tokens - 1))


def accepted_prefix(drafts: list[int], greedy: list[int]) -> int:
    """How many leading drafts equal the greedy tokens at their positions."""
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return a


# --- the engine's two calls: drafts after scheduling, verdicts after the forward ------------------


def attach_drafts(scheduled: list[ScheduledSeq], max_per_seq: int, max_num_batched_tokens: int, block_size: int,
                  max_position: int) -> None:
    """Give the step's greedy decoding sequences their n-gram drafts (``ScheduledSeq.draft_token_ids``),
    within the step's token budget. None in a step that computes prompt tokens."""
    decodes = [item for item in scheduled
               if item.num_new_tokens == 1 and item.seq.num_computed_tokens + 1 == item.seq.num_tokens]
    if len(decodes) < len(scheduled):
        # The step computes prompt tokens, so arithmetic bounds it, not reading the weights: a
        # draft row would cost as much as a prompt row and delay those prompts' first tokens.
        return
    decodes = [item for item in decodes if eligible(item.seq)]
    per_seq = draft_budget(len(decodes), max_per_seq)
    budget = max_num_batched_tokens - len(scheduled)  # every item is a one-token decode
    for item in decodes:
        seq = item.seq
        k = min(per_seq, budget, room_for_drafts(seq, block_size, max_position))
        if k <= 0:
            continue
        if seq.ngrams is None:
            seq.ngrams = NgramIndex()
        item.draft_token_ids = seq.ngrams.propose(seq, k)
        budget -= len(item.draft_token_ids)


class StepDrafts:
    """One step's drafts and the model's verdict on them, by scheduled row.

    The runner's logits are (B + D, V): row b after scheduled sequence b's last token, then one row
    after each of the D drafts, sequence after sequence (model_runner.py). For a sequence that
    drafted, the token sampled from its own row (greedy: it is the argmax) is followed by the argmax
    after each of its drafts; ``append`` keeps what the drafts agreed with.

    Args:
        scheduled: the step's sequences, in row order.
        logits: the step's (B + D, V) logits (None when nothing ran).
    """

    def __init__(self, scheduled: list[ScheduledSeq], logits: torch.Tensor | None) -> None:
        # row -> (its drafts, the greedy token after each draft); empty when nothing drafted.
        self._verdicts: dict[int, tuple[list[int], list[int]]] = {}
        self.num_draft_tokens = 0  # drafts computed this step
        if logits is None or logits.shape[0] == len(scheduled):
            return
        after_drafts = greedy_tokens(logits[len(scheduled):])
        start = 0
        for row, item in enumerate(scheduled):
            if item.draft_token_ids:
                end = start + len(item.draft_token_ids)
                self._verdicts[row] = (item.draft_token_ids, after_drafts[start:end])
                start = end
        if start != len(after_drafts):
            raise RuntimeError(f"{len(after_drafts)} draft rows of logits for {start} drafts")
        self.num_draft_tokens = start

    def append(self, row: int, seq: Sequence, token: int, append_token: Callable[[int], None]) -> int:
        """Append ``token`` (sampled from ``row``), then, if the sequence drafted, the greedy tokens
        its drafts agreed with and the one after them, until a stop ends it.

        Args:
            row: the sequence's scheduled row.
            seq: the sequence.
            token: the token sampled from its row.
            append_token: the engine's append (stop checks, detokenizing) of one token to ``seq``.

        Returns:
            The drafts that became output (a stop may end the sequence before the last accepted one).
        """
        verdict = self._verdicts.get(row)
        if verdict is None:
            append_token(token)
            return 0
        drafts, after_drafts = verdict
        greedy = [token, *after_drafts]
        num_accepted = accepted_prefix(drafts, greedy)
        num_appended = 0
        for greedy_token in greedy[: num_accepted + 1]:
            append_token(greedy_token)
            num_appended += 1
            if seq.is_finished:
                break
        num_kept = min(num_accepted, num_appended)
        if not seq.is_finished:
            seq.accept_drafts(num_kept)
        return num_kept
