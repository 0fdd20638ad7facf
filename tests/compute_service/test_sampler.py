"""The sampler: the greedy fast path (one argmax over the batch, identical to torch's: first maximum,
NaN wins), and batched random sampling, exactly the per-row sorted reference's distributions and, with
seeded generators, its tokens."""

from __future__ import annotations

import pytest
import torch

from compute_service.engine import sampler
from compute_service.engine.sampler import greedy_tokens
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def test_greedy_tokens_equal_torch_argmax_on_ties_nan_and_inf() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(48, 4099, generator=g),
        torch.randint(-3, 3, (17, 1000), generator=g).float(),  # many ties: the first maximum
        torch.full((3, 333), float("-inf")),  # all -inf: index 0
    ]
    nan = torch.randn(9, 777, generator=g)
    nan[torch.rand(9, 777, generator=g) < 0.01] = float("nan")  # a NaN counts as the maximum
    nan[0, 5] = nan[0, 600] = float("nan")
    inf = torch.randn(4, 500, generator=g)
    inf[1, 10] = inf[1, 20] = float("inf")
    signed_zero = torch.zeros(2, 64)
    signed_zero[0, :10] = -0.0
    cases += [nan, inf, signed_zero, torch.randn(64, 8, generator=g).t()]  # the last one not contiguous
    for logits in cases:
        assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(cases[2]) == [0, 0, 0] and greedy_tokens(nan)[0] == 5 and greedy_tokens(inf)[1] == 10
    half = torch.randn(5, 300, generator=g).bfloat16()  # not float32: torch's own argmax
    assert greedy_tokens(half) == half.argmax(dim=-1).tolist()


# -- random sampling: the batched sampler against the per-row sorted reference ------------------------

def _seqs(params: list[SamplingParams], seed: int) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(seq_id=f"s{i}", request_id=f"r{i}", prompt_token_ids=[1, 2, 3, 2], params=p)
        seq.output_token_ids = [5, 5, 7]
        if p.seed is not None:
            seq.generator = torch.Generator().manual_seed(seed + i)
        seqs.append(seq)
    return seqs


def _reference(logits: torch.Tensor, seqs: list[Sequence], eos: list[int]) -> list[int]:
    """The per-row implementation every earlier version ran (a full sort for top-p)."""
    out = []
    for row, seq in zip(logits, seqs):
        row = row.clone()
        if seq.num_output_tokens < seq.params.min_tokens:
            row[eos] = float("-inf")
        sampler._apply_penalties(row, seq)
        out.append(int(row.argmax()) if seq.params.is_greedy else sampler._sample_row(row, seq))
    return out


PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=50, seed=2),
    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=3),
    SamplingParams(temperature=1.0, seed=4),  # no truncation: the full vector
    SamplingParams(temperature=1.2, top_k=5, seed=5),
    SamplingParams(temperature=0.9, top_p=0.1, repetition_penalty=1.3, presence_penalty=0.5, seed=6),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),  # greedy among random rows
    SamplingParams(temperature=1.0, top_p=0.999, seed=7),  # a nucleus past the candidates: the sort
    SamplingParams(temperature=0.8, top_p=0.95, min_tokens=10, seed=8),
]


@pytest.mark.parametrize("kind", ["peaked", "flat", "flatter", "bf16-ties", "masked"])
def test_seeded_tokens_equal_the_sorted_reference(kind: str, monkeypatch) -> None:
    g = torch.Generator().manual_seed(11)
    vocab, eos = 3000, [0, 1]
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES_WIDE", 1024)  # the wide tier on a small vocabulary
    logits = torch.randn(len(PARAMS), vocab, generator=g) * {"flat": 2.0, "flatter": 0.3}.get(kind, 6.0)
    if kind == "bf16-ties":  # what a bf16 model's logits look like: many exact ties
        logits = logits.bfloat16().float()
    if kind == "masked":
        logits[:, 100:] = float("-inf")
        logits[3] = float("-inf")  # a row with nothing left: the argmax
    for step in range(4):
        raw = logits.roll(step * 37, dims=1)
        before = raw.clone()
        got = sampler.sample(raw, _seqs(PARAMS, seed=step), eos)
        assert got == _reference(raw, _seqs(PARAMS, seed=step), eos)
        assert torch.equal(raw, before)  # penalties and min_tokens in a copy: logprobs see raw rows


def test_the_nucleus_from_candidates_is_the_sorted_one_or_none() -> None:
    g = torch.Generator().manual_seed(12)
    taken = 0
    for trial in range(300):
        scale = [0.2, 2.0, 8.0][trial % 3]
        logits = torch.randn(5000, generator=g, dtype=torch.float64) * scale
        if trial % 2:
            logits = logits.bfloat16().double()  # ties
        probs = torch.softmax(logits, 0)
        top_p = [0.5, 0.9, 0.95, 0.99][trial % 4]
        want = sampler._top_p_sorted(probs, top_p)
        values, ids = probs.topk(sampler.TOP_P_CANDIDATES)
        found = sampler._nucleus(values, ids, top_p)
        if found is None:
            continue
        taken += 1
        got = torch.zeros_like(probs).index_put_((found[0],), found[1])
        assert torch.equal(got, want)
    assert taken > 100  # the fast path is the common one


def test_the_unseeded_draw_follows_the_distribution_and_never_picks_a_zero() -> None:
    torch.manual_seed(13)
    probs = torch.tensor([0.0, 0.5, 0.3, 0.0, 0.2], dtype=torch.float64)
    counts = torch.bincount(torch.tensor([sampler._draw(probs, None) for _ in range(4000)]), minlength=5)
    assert counts[0] == counts[3] == 0
    assert abs(counts[1] / 4000 - 0.5) < 0.04 and abs(counts[2] / 4000 - 0.3) < 0.04


def test_unseeded_rows_sample_inside_the_nucleus() -> None:
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(8, 3000, generator=g) * 6.0
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 8
    probs = torch.softmax(logits.double() / 0.8, dim=-1)
    allowed = [set(sampler._top_p_sorted(p, 0.9).nonzero().flatten().tolist()) for p in probs]
    for _ in range(20):
        tokens = sampler.sample(logits, _seqs(params, seed=0), [0])
        assert all(t in ok for t, ok in zip(tokens, allowed))


def test_each_tier_of_the_nucleus_search_is_taken(monkeypatch) -> None:
    """256 candidates for a peaked row, the wide tier for a flatter one, the sort for a flat one."""
    calls = []
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES_WIDE", 1024)
    nucleus, sort = sampler._nucleus, sampler._top_p_sorted
    monkeypatch.setattr(sampler, "_nucleus", lambda v, i, p: calls.append(len(v)) or nucleus(v, i, p))
    monkeypatch.setattr(sampler, "_top_p_sorted", lambda probs, p: calls.append("sort") or sort(probs, p))
    g = torch.Generator().manual_seed(15)
    for scale, want in ((8.0, [256]), (2.0, [256, 1024]), (0.1, [256, 1024, "sort"])):
        calls.clear()
        sampler.sample(torch.randn(1, 3000, generator=g) * scale, _seqs([SamplingParams(top_p=0.9, seed=1)], 0), [0])
        assert calls == want, (scale, calls)


def test_apply_logit_bias_is_one_batched_add_leaving_the_raw_rows() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    raw = logits.clone()

    class Seq:
        def __init__(self, params: SamplingParams) -> None:
            self.params = params

    seqs = [Seq(SamplingParams(logit_bias={4: -100.0, 7: 2.5})), Seq(SamplingParams()),
            Seq(SamplingParams(logit_bias={4: 1.0}))]
    biased = sampler.apply_logit_bias(logits, seqs)
    expected = raw.clone()
    expected[0, 4] -= 100.0
    expected[0, 7] += 2.5
    expected[2, 4] += 1.0
    assert torch.equal(biased, expected) and torch.equal(logits, raw)
    assert sampler.apply_logit_bias(logits, [Seq(SamplingParams())] * 3) is logits


def test_batched_unseeded_draws_stay_in_the_nucleus_or_defer() -> None:
    # _nucleus_draws (every unseeded top-p row without top_k/min_p) picks inside _top_p_sorted's
    # nucleus, and defers (None) where its 256 candidates cannot tell: a flat row whose nucleus is
    # wider, a tie at the nucleus's edge, a row with no finite distribution.
    g = torch.Generator().manual_seed(16)
    peaked = torch.randn(6, 3000, generator=g) * 6.0
    flat = torch.randn(1, 3000, generator=g) * 0.01
    tied = torch.full((1, 3000), -5.0)
    tied[0, :300] = 4.0  # 300 equal leaders: a nucleus of 0.5 ends inside a tie wider than the candidates
    masked = torch.full((1, 3000), float("-inf"))
    rows = torch.cat([peaked, flat, tied, masked])
    temps, top_ps = [0.8] * 9, [0.9] * 7 + [0.5, 0.9]
    allowed = [set(sampler._top_p_sorted(torch.softmax(r.double() / t, -1), p).nonzero().flatten().tolist())
               for r, t, p in zip(rows[:6], temps, top_ps)]
    for _ in range(10):
        got = sampler._nucleus_draws(rows, temps, top_ps)
        assert all(token in ok for token, ok in zip(got[:6], allowed))
        assert got[6:] == [None, None, None]
    # Through sample(): the deferred rows take the exact path (the masked row its argmax).
    tokens = sampler.sample(rows, _seqs([SamplingParams(temperature=0.8, top_p=p) for p in top_ps], 0), [0])
    assert tokens[7] < 150 and tokens[8] == 0  # the tie's lowest ids, as the sorted reference keeps them


def test_batched_draws_break_ties_at_the_edge_by_token_id() -> None:
    # bf16 logits tie often: a nucleus ending inside a tie of the candidates keeps that tie's lowest
    # ids, as the stable sort does (before: the row deferred to the exact path).
    row = torch.full((1, 2000), -9.0)
    row[0, [700, 40, 1500, 3]] = 2.0  # four equal leaders (~0.25 each): top_p 0.4 keeps two of them
    got = {sampler._nucleus_draws(row, [1.0], [0.4])[0] for _ in range(200)}
    assert got == {3, 40}


def test_the_fused_nucleus_draws_pick_the_torch_versions_tokens() -> None:
    # pagedserve_cpu::nucleus_draws (one C++ call) against _nucleus_draws_torch given the same
    # uniforms: the same token, or the same deferral, on peaked, flat, tied (bf16-like), masked, NaN
    # and +inf rows, and on a vocabulary smaller than the candidates.
    ops = sampler._nucleus_ops()
    if ops is None:
        pytest.skip("no fused CPU kernels with nucleus_draws here")
    g = torch.Generator().manual_seed(31)
    peaked = torch.randn(24, 5000, generator=g) * 6.0
    realistic = (torch.randn(8, 5000, generator=g) * 3.0).bfloat16().float()  # ties, as bf16 logits have
    flat = torch.randn(2, 5000, generator=g) * 0.01
    tied = torch.full((1, 5000), -5.0)
    tied[0, :300] = 4.0
    masked = torch.full((1, 5000), float("-inf"))
    masked_some = peaked[:1].clone()
    masked_some[0, 100:] = float("-inf")  # fewer finite values than candidates
    odd = torch.randn(3, 5000, generator=g) * 4.0
    odd[0, 17], odd[1, 3] = float("nan"), float("inf")
    # A model's shape: a few leaders far above a crowd (Qwen2.5's: 10 within 8 of the top, 2,000 within
    # 16), so the first doubling that holds the candidates holds thousands and finer deltas are counted.
    crowd = torch.randn(4, 5000, generator=g) * 0.5
    crowd[:, :8] += torch.tensor([14.0, 13.0, 12.5, 12.0])[:, None] + torch.rand(4, 8, generator=g) * 3
    # ... and one where no finer delta holds them (3,300 within 16 of the top, 1 within 15.2): the
    # coarse delta stays
    gap = torch.full((1, 5000), -100.0)
    gap[0, 0], gap[0, 1:301], gap[0, 301:3301] = 0.0, -15.5, -15.95
    crowd = torch.cat([crowd, gap])
    rows = torch.cat([peaked, realistic, flat, tied, masked, masked_some, odd, crowd])
    temps = [0.8 if i % 3 else 1.3 for i in range(rows.shape[0])]
    top_ps = [0.95 if i % 2 else 0.5 for i in range(rows.shape[0])]
    for seed in range(5):
        uniform = torch.rand(rows.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        want = sampler._nucleus_draws_torch(rows, temps, top_ps, uniform)
        picks = ops.nucleus_draws(rows, torch.tensor([1 / t for t in temps], dtype=torch.float32),
                                  torch.tensor(top_ps, dtype=torch.float64), uniform, sampler.TOP_P_CANDIDATES)
        assert [p if p >= 0 else None for p in picks.tolist()] == want
        assert all(w is not None for w in want[-len(crowd):])  # the crowd rows are decided
    assert sum(w is not None for w in want) >= 30  # most rows decided: the comparison is not vacuous
    small = torch.randn(2, 100, generator=g) * 3.0  # V < candidates: all of them are
    uniform = torch.rand(2, dtype=torch.float64)
    picks = ops.nucleus_draws(small, torch.ones(2), torch.tensor([0.9, 0.9], dtype=torch.float64), uniform,
                              sampler.TOP_P_CANDIDATES).tolist()
    assert picks == sampler._nucleus_draws_torch(small, [1.0, 1.0], [0.9, 0.9], uniform)
