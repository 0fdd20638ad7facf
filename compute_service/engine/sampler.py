"""Token selection from the last-position logits of each sequence."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import Sequence


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        ids, counts = torch.tensor(seq.output_token_ids, device=row.device).unique(return_counts=True)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)
    return row


def _min_tokens_banned(params: SamplingParams, eos_token_ids: Seq[int], device: torch.device) -> torch.Tensor:
    """The ids masked while a completion is under min_tokens (EOS and the stop ids), built once per
    request: each step's cost does not grow with the number of stop ids."""
    banned = params.derived.get("min_tokens_banned")
    if not isinstance(banned, torch.Tensor) or banned.device != device:
        ids = sorted({*eos_token_ids, *params.stop_token_id_set})
        banned = params.derived["min_tokens_banned"] = torch.tensor(ids, dtype=torch.long, device=device)
    return banned


def _sample_row(row: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    # float64: a float32 temperature as small as 1e-45 overflows float32 logits to inf (NaN probs).
    row = row.double() / p.temperature
    if p.top_k and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        # Every token penalised to -inf: no distribution is left; its limit is the argmax.
        return int(row.argmax())
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(dim=-1).tolist()``: the first maximum of each row, a NaN counting as the maximum.

    On a CPU float32 batch through numpy, whose argmax is vectorised where torch's is not (several
    times faster on the default model's logits), with the same indices (ties, NaN, inf).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and not logits.requires_grad:
        return logits.numpy().argmax(axis=1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Seq[int]) -> list[int]:
    """Pick the next token of each sequence.

    Args:
        logits: (B, V) float32, one row per sequence in ``seqs``.
        seqs: the sequences; their params say greedy or random, penalties and min_tokens.
        eos_token_ids: the model's end tokens (masked while a sequence is under min_tokens).
    Returns:
        B token ids.
    """
    plain = all(s.params.is_greedy and not s.params.has_penalties and not s.params.min_tokens for s in seqs)
    if plain:  # the common benchmark and test path: one argmax for the whole batch
        return greedy_tokens(logits)
    out = []
    for row, seq in zip(logits, seqs, strict=True):
        row = row.clone()
        if seq.num_output_tokens < seq.params.min_tokens:
            row[_min_tokens_banned(seq.params, eos_token_ids, row.device)] = float("-inf")
        row = _apply_penalties(row, seq)
        out.append(int(row.argmax()) if seq.params.is_greedy else _sample_row(row, seq))
    return out


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token (log-softmax of the raw logits: before penalties,
    temperature and truncation, the way OpenAI-style APIs report them)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]  # the N most likely, most likely first
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, token_ids: Seq[int], num_top: Seq[int]) -> list[TokenLogprobs]:
    """Log-probabilities of the sampled tokens.

    Args:
        logits: (B, V) float32 raw logits.
        token_ids: B sampled tokens.
        num_top: per row, how many most-likely tokens to report besides the sampled one.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long, device=logits.device)[:, None])[:, 0]
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return [
        TokenLogprobs(token_id=t, logprob=float(c), top_token_ids=ids[:n].tolist(), top_logprobs=values[:n].tolist())
        for t, c, ids, values, n in zip(token_ids, chosen, top_ids, top_values, num_top, strict=True)
    ]
