"""logit_bias in the engine, in process on the tiny byte-tokenizer Llama: added
before sampling and before a constraint's mask, one batched op for the whole step; logprobs stay
the raw logits'; n > 1 forks and speculative drafts respect it. The batched add itself is a unit
test of the sampler (tests/compute_service/test_sampler.py)."""

from __future__ import annotations

import pytest

from compute_service import LLM, Constraint, SamplingParams
from pagedserve.errors import InvalidArgument
from tests.structured.conftest import PROMPTS, VOCAB
from tests.structured.test_engine_constraints import run_batch


def _tokens(llm: LLM, prompt: list[int], **params: object) -> list[int]:
    [out] = llm.generate([prompt], SamplingParams(**params))
    return out.outputs[0].token_ids


def test_minus_100_on_the_greedy_token_changes_it_and_plus_100_forces_one(llm: LLM) -> None:
    prompt = PROMPTS[0]
    [first, *_] = _tokens(llm, prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    banned = _tokens(llm, prompt, max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0})
    assert banned[0] != first
    forced = 65 if first != 65 else 66
    # Greedy and a repeated token: the n-gram drafter would propose it, yet each token is the biased argmax.
    assert _tokens(llm, prompt, max_tokens=12, temperature=0.0, ignore_eos=True,
                   logit_bias={forced: 100.0}) == [forced] * 12
    for seed in range(3):  # sampled at temperature 1.0 too
        assert _tokens(llm, prompt, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True,
                       logit_bias={forced: 100.0}) == [forced] * 6


def test_a_biased_request_leaves_its_batch_alone_and_forks_keep_the_bias(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3, ignore_eos=True, logit_bias={70: 100.0})
    outs = run_batch(llm, [(PROMPTS[1], plain), (PROMPTS[2], forked), (PROMPTS[3], plain)])
    assert [c.token_ids for c in outs[1].outputs] == [[70] * 5] * 3
    for out, prompt in ((outs[0], PROMPTS[1]), (outs[2], PROMPTS[3])):
        assert out.outputs[0].token_ids == _tokens(llm, prompt, max_tokens=8, temperature=0.0, ignore_eos=True)


def test_logprobs_stay_those_of_the_raw_logits(llm: LLM) -> None:
    prompt = PROMPTS[3]
    [raw] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    [biased] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5,
                                                     logit_bias={90: 100.0}))
    [lp], [want] = biased.outputs[0].logprobs, raw.outputs[0].logprobs
    assert lp.token_id == 90 and lp.logprob < -1.0  # the raw probability of a token the bias forced
    assert lp.top_token_ids == want.top_token_ids and lp.top_logprobs == pytest.approx(want.top_logprobs)


def test_the_bias_comes_before_the_grammar_mask(llm: LLM, byte_model) -> None:
    choices = ["yes", "no", "maybe"]
    encode = byte_model.tokenizer.encode
    [n_token] = encode("n", add_special_tokens=False)
    [z_token] = encode("z", add_special_tokens=False)
    for seed in range(3):
        # +100 on a token the grammar forbids: the mask still excludes it.
        [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=1.0, seed=seed,
                                                          constraint=Constraint.choice(choices),
                                                          logit_bias={z_token: 100.0}))
        assert byte_model.tokenizer.decode(out.outputs[0].token_ids[:-1]) in choices
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.0,
                                                      constraint=Constraint.choice(choices),
                                                      logit_bias={n_token: 100.0}))
    assert byte_model.tokenizer.decode(out.outputs[0].token_ids[:-1]) == "no"


def test_bad_biases_name_the_field(llm: LLM) -> None:
    with pytest.raises(InvalidArgument, match=r"^logit_bias\[3\] must be in \[-100.0, 100.0\], got 101"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(InvalidArgument, match=r"^logit_bias: at most 300 entries, got 301"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})
    with pytest.raises(InvalidArgument, match=r"finite"):
        SamplingParams(logit_bias={3: float("nan")})
    with pytest.raises(InvalidArgument, match=rf"^params.logit_bias\[0\] must be in \[0, {VOCAB}\), got {VOCAB}"):
        llm.engine.add_request("bad-bias", PROMPTS[0], SamplingParams(logit_bias={VOCAB: 1.0}))
