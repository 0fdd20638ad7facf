"""Token selection from the last-position logits of each sequence."""

from __future__ import annotations

import functools
import math
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


# How many of a row's most likely tokens the top-p fast path looks at: the nucleus of real text at
# top_p 0.9-0.95 is a few to a few dozen tokens of the default model's 49152, and a `topk` of 256 is
# a small fraction of a full sort's cost (docs/benchmarks.md). A nucleus that does not fit tries
# `TOP_P_CANDIDATES_WIDE` (flat distributions: the start of a sentence), then takes the sort.
TOP_P_CANDIDATES = 256
TOP_P_CANDIDATES_WIDE = 4096
MIN_BATCHED_TEMPERATURE = 1e-3


def _sample_row(row: torch.Tensor, seq: Sequence) -> int:
    """The reference: one sequence, a full sort for top-p (ties in the order of their token ids).

    `sample` computes the same distribution without the sort where it can (`_nucleus`), and with a
    seeded generator draws the same token; tests compare the two.
    """
    p = seq.params
    row = row.double() / p.temperature
    if p.top_k and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        probs = _top_p_sorted(probs, p.top_p)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        return int(row.argmax())
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def _top_p_sorted(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (V,) with every token outside the nucleus zeroed: the smallest prefix of the tokens sorted
    by probability (ties by token id) whose mass reaches top_p, the token crossing it included."""
    sorted_probs, order = probs.sort(descending=True, stable=True)
    drop = sorted_probs.cumsum(0) - sorted_probs > top_p
    return probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))


def _nucleus(values: torch.Tensor, ids: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The nucleus from a row's `TOP_P_CANDIDATES` most likely tokens, or None where they cannot tell.

    Args:
        values, ids: (K,) the row's K largest probabilities, descending, and their token ids.
    Returns:
        (ids, probabilities) of the nucleus, exactly the tokens `_top_p_sorted` keeps; None when the
        nucleus may reach past the K (all K kept), or when its last token ties with the K-th value
        (tokens of that value outside the K might come first by id).

    Why it is exact: the exclusive prefix sums of the first n sorted probabilities depend on those n
    alone (cumsum adds in order, and equal values added in any order give the same sums), so the
    keep/drop decision of each of the K is the sort's; every token past the K has an exclusive sum at
    least the K-th's, which exceeds top_p whenever one of the K is dropped.
    """
    if bool((values[1:] == values[:-1]).any()):  # ties: put them in token-id order, as the stable sort
        ids, by_id = ids.sort()
        values, by_value = values[by_id].sort(descending=True, stable=True)
        ids = ids[by_value]
    num_kept = int((values.cumsum(0) - values <= top_p).sum())
    if num_kept == values.shape[0] or values[num_kept - 1] == values[-1]:
        return None
    return ids[:num_kept], values[:num_kept]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to probs (R,) (non-negative, positive sum).

    With a generator: `torch.multinomial` on the vector as given, the draw every earlier version made
    (it draws one exponential per entry, the costliest part of a seeded row), so a seed gives the same
    tokens. Without: inverse CDF, one uniform and a binary search over the cumulative sum.
    """
    if generator is not None:
        return int(torch.multinomial(probs, 1, generator=generator))
    cdf = probs.cumsum(0)
    u = torch.rand((), dtype=cdf.dtype) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


@functools.cache
def _nucleus_ops():
    """The C++ ops when they have nucleus_draws, else None (looked up once)."""
    from pagedserve_kernels import cpu_ops  # loads the extension (built at engine start already)

    ops = cpu_ops.load()
    return ops if ops is not None and ops.has_nucleus_draws() else None


def _nucleus_draws(rows: torch.Tensor, temperatures: list[float], top_ps: list[float]) -> list[int | None]:
    """`_nucleus_draws_torch`, in one C++ call where the fused CPU kernels have it
    (`pagedserve_cpu::nucleus_draws`: the same steps on each row; ~25 tensor ops fewer a step, each on
    caches a decode step's weights have just evicted)."""
    uniform = torch.rand(len(top_ps), dtype=torch.float64)  # one per row, drawn first either way
    ops = _nucleus_ops() if rows.device.type == "cpu" and rows.dtype == torch.float32 else None
    if ops is None:
        return _nucleus_draws_torch(rows, temperatures, top_ps, uniform)
    inv_t = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)
    picks = ops.nucleus_draws(rows.contiguous(), inv_t, torch.tensor(top_ps, dtype=torch.float64), uniform,
                              TOP_P_CANDIDATES)
    return [token if token >= 0 else None for token in picks.tolist()]


def _nucleus_draws_torch(rows: torch.Tensor, temperatures: list[float], top_ps: list[float],
                         uniform: torch.Tensor) -> list[int | None]:
    """Unseeded top-p draws for F rows (F, V) at once, from their `TOP_P_CANDIDATES` largest logits.

    The batched form of the exact path's first tier for rows without a generator, top_k or min_p:
    the candidates are the largest raw logits (the same tokens as the largest probabilities, the
    temperature being positive), the softmax's denominator one pass of exp over each row (float32
    terms summed in float64), the candidates' probabilities and their exclusive prefix sums in float64
    as a (F, K) batch, one uniform per row. Each row's nucleus is `_top_p_sorted`'s, except that a
    probability may differ from the float64 softmax's in its 7th digit (the float32 exp terms), which
    moves the nucleus's edge only for a token whose prefix sum is within that of top_p. None for a row
    these candidates cannot decide (`_nucleus`'s cases: the nucleus may reach past them, or its edge
    ties with the K-th value, so maybe with tokens outside them), or without a finite distribution:
    the caller takes the exact path. ``uniform``: (F,) float64 in [0, 1), each row's draw.
    """
    k = min(TOP_P_CANDIDATES, rows.shape[1])
    values, ids = rows.topk(k, dim=-1)  # (F, K) descending
    # Equal values in token-id order, as the stable sort has them (bf16 logits tie often): a tie at
    # the nucleus's edge then keeps the same tokens as the sort, unless it reaches the K-th value.
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    top = values[:, :1]  # (F, 1) each row's largest logit
    inv_t = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)[:, None]
    z = torch.sub(rows, top).mul_(inv_t).exp_().sum(dim=-1, dtype=torch.float64)  # (F,) softmax denominators
    probs = (values.double() - top.double()).mul_(inv_t.double()).exp_().div_(z[:, None])  # (F, K)
    cdf = probs.cumsum(dim=-1)
    kept = (cdf - probs) <= torch.tensor(top_ps, dtype=torch.float64)[:, None]  # exclusive sums <= top_p
    num_kept = kept.sum(dim=-1)  # (F,) >= 1 for a finite row (the first exclusive sum is 0)
    last_kept = (num_kept - 1).clamp(min=0)
    last = values.gather(1, last_kept[:, None])[:, 0]
    decided = (num_kept > 0) & (num_kept < k) & (last != values[:, -1]) & torch.isfinite(z) & (z > 0)
    u = uniform * cdf.gather(1, last_kept[:, None])[:, 0]
    picks = (cdf < u[:, None]).sum(dim=-1).minimum(last_kept)  # inverse CDF within the nucleus
    tokens = ids.gather(1, picks[:, None])[:, 0]
    return [t if ok else None for t, ok in zip(tokens.tolist(), decided.tolist())]


def _sample_random(rows: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
    """Random sampling of R rows (R, V): unseeded top-p rows without top_k or min_p batched through
    `_nucleus_draws` (the realistic workload's every row), the others and the rows it cannot decide
    through `_sample_exact`."""
    # (Temperatures below MIN_BATCHED_TEMPERATURE stay exact: 1 / T in float32 must stay finite.)
    fast = [r for r, seq in enumerate(seqs) if seq.generator is None and seq.params.top_p < 1.0
            and not seq.params.top_k and not seq.params.min_p > 0
            and seq.params.temperature >= MIN_BATCHED_TEMPERATURE]
    out: list[int | None] = [None] * len(seqs)
    if fast:
        subset = rows if len(fast) == len(seqs) else rows[fast]
        draws = _nucleus_draws(subset.float(), [seqs[r].params.temperature for r in fast],
                               [seqs[r].params.top_p for r in fast])
        for r, token in zip(fast, draws):
            out[r] = token
    rest = [r for r, token in enumerate(out) if token is None]
    if rest:
        subset = rows if len(rest) == len(seqs) else rows[rest]
        for r, token in zip(rest, _sample_exact(subset, [seqs[r] for r in rest])):
            out[r] = token
    return out  # type: ignore[return-value]


def _sample_exact(rows: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
    """Random sampling of R rows (R, V) at once: temperature, top-k, softmax and min-p as (R, V) ops,
    each row's nucleus from one batched `topk` (`_nucleus`), the full sort only where it cannot tell.

    Every row's distribution is `_sample_row`'s, value for value (float64 as there; batched softmax
    and min-p give each row the bits a single-row call does), and a seeded row draws its token from
    the same full-vocabulary vector with the same call.
    """
    vocab = rows.shape[1]
    params = [seq.params for seq in seqs]
    # float64: a float32 temperature as small as 1e-45 overflows float32 logits to inf (NaN probs).
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float64)[:, None]
    x = rows.to(torch.float64, copy=True).div_(temperatures)
    top_ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    if any(top_ks):
        kth = x.topk(max(top_ks), dim=-1).values  # (R, max k), descending
        for r, k in enumerate(top_ks):
            if k:
                x[r] = x[r].masked_fill(x[r] < kth[r, k - 1], float("-inf"))
    probs = torch.softmax(x, dim=-1)  # (R, V)
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        floor = torch.tensor(min_ps, dtype=torch.float64)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)  # rows with min_p 0: floor 0, nothing below it
    totals = probs.sum(dim=-1).tolist()
    nucleus_rows = [r for r, p in enumerate(params) if p.top_p < 1.0]
    candidates = None
    if nucleus_rows:
        k = min(TOP_P_CANDIDATES, vocab)
        nucleus_probs = probs if len(nucleus_rows) == len(params) else probs[nucleus_rows]
        candidates = nucleus_probs.topk(k, dim=-1)  # (N, K) values, ids; descending
    out = []
    for r, seq in enumerate(seqs):
        total = totals[r]
        if not (total > 0 and math.isfinite(total)):  # every token masked or penalised to -inf
            out.append(int(x[r].argmax()))  # no distribution is left; its limit is the argmax
            continue
        row, top_p = probs[r], params[r].top_p
        if top_p < 1.0:
            i = nucleus_rows.index(r)
            found = _nucleus(candidates.values[i], candidates.indices[i], top_p)
            if found is None and vocab > TOP_P_CANDIDATES_WIDE:
                found = _nucleus(*row.topk(TOP_P_CANDIDATES_WIDE), top_p)
            if found is None:
                row = _top_p_sorted(row, top_p)
            elif seq.generator is None:
                ids, values = found
                out.append(int(ids[_draw(values, None)]))
                continue
            else:  # the same full vector the sort makes, for the seeded draw
                ids, values = found
                row = torch.zeros_like(row).index_put_((ids,), values)
        out.append(_draw(row, seq.generator))
    return out
def _logit_bias_tensors(params: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (ids, biases) tensors, built once per request (in ``derived``)."""
    cached = params.derived.get("logit_bias")
    if not isinstance(cached, tuple) or cached[0].device != device:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        biases = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        cached = params.derived["logit_bias"] = (ids, biases)
    return cached


def apply_logit_bias(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """``logits`` plus each sequence's logit_bias: one index_put over every entry of the batch.

    Args:
        logits: (B, V), one row per sequence in ``seqs``.
    Returns:
        A new (B, V) tensor, or ``logits`` itself when no sequence has a bias. Never in place: the
        raw rows give logprobs, and an n > 1 fork samples again from its parent's raw row.
    """
    rows, ids, biases = [], [], []
    for row, seq in enumerate(seqs):
        if seq.params.logit_bias:
            seq_ids, seq_biases = _logit_bias_tensors(seq.params, logits.device)
            rows.append(torch.full_like(seq_ids, row))
            ids.append(seq_ids)
            biases.append(seq_biases)
    if not rows:
        return logits
    return logits.index_put((torch.cat(rows), torch.cat(ids)), torch.cat(biases).to(logits.dtype), accumulate=True)


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
        logits: (B, V) float32, one row per sequence in ``seqs`` (not changed).
        seqs: the sequences; their params say greedy or random, penalties and min_tokens.
        eos_token_ids: the model's end tokens (masked while a sequence is under min_tokens).
    Returns:
        B token ids.
    """
    plain = all(s.params.is_greedy and not s.params.has_penalties and not s.params.min_tokens for s in seqs)
    if plain:  # the common benchmark and test path: one argmax for the whole batch
        return greedy_tokens(logits)
    under_min = [seq.num_output_tokens < seq.params.min_tokens for seq in seqs]
    if any(under_min) or any(seq.params.has_penalties for seq in seqs):
        logits = logits.clone()  # the raw rows stay for logprobs and for n > 1 forks sampling again
        for row, seq, banned in zip(logits, seqs, under_min, strict=True):
            if banned:
                row[_min_tokens_banned(seq.params, eos_token_ids, row.device)] = float("-inf")
            if seq.params.has_penalties:
                _apply_penalties(row, seq)
    out: list[int | None] = [None] * len(seqs)
    greedy = [b for b, seq in enumerate(seqs) if seq.params.is_greedy]
    if greedy:
        for b, token in zip(greedy, greedy_tokens(logits[greedy])):
            out[b] = token
    randoms = [b for b, seq in enumerate(seqs) if not seq.params.is_greedy]
    if randoms:
        rows = logits if len(randoms) == len(seqs) else logits[randoms]
        for b, token in zip(randoms, _sample_random(rows, [seqs[b] for b in randoms])):
            out[b] = token
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token (log-softmax of the raw logits: before penalties,
    temperature and truncation, the way OpenAI-style APIs report them)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]  # the N most likely, most likely first
    top_logprobs: list[float]
    rank: int = 0  # 1 + the tokens more likely than token_id (prompt logprobs; 0 = not computed)


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


def prompt_token_logprobs(logits: torch.Tensor, token_ids: Seq[int], num_top: int) -> list[TokenLogprobs]:
    """Log-probabilities of given tokens (a prompt's), with their rank and the ``num_top`` most likely.

    Args:
        logits: (P, V) raw logits; row i is the distribution ``token_ids[i]`` was drawn from.
        token_ids: P tokens.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (P, V), float32 whatever the model's dtype
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long, device=logits.device)[:, None])  # (P, 1)
    ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    return [
        TokenLogprobs(token_id=t, logprob=c, top_token_ids=ids, top_logprobs=values, rank=r)
        for t, c, ids, values, r in zip(token_ids, chosen[:, 0].tolist(), top_ids.tolist(), top_values.tolist(),
                                        ranks, strict=True)
    ]
