"""Prompt logprobs in the engine (in process, the tiny random Llama): equal to transformers' float32
log-softmax at every prompt position, whole or in chunks, after preemption, and never read from the
prefix cache."""

from __future__ import annotations

import random

import pytest
import torch

from compute_service.engine.outputs import RequestOutput, collect
from compute_service.engine.sampling_params import SamplingParams
from pagedserve.errors import InvalidArgument

from tests.compute_service.tiny_llama import VOCAB, in_process_engine


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """(L - 1, V): transformers' float32 log-softmax at positions 0..L-2 (the next prompt token's)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def run(engine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        collect(results, engine.step())
    return [results[f"r{i}"] for i in range(len(prompts))]


def check(hf_model, prompt: list[int], out: RequestOutput, num_top: int) -> None:
    want = hf_prompt_logprobs(hf_model, prompt)
    got = out.prompt_logprobs
    assert got is not None and [lp.token_id for lp in got] == prompt[1:]
    for position, lp in enumerate(got):
        row = want[position]
        assert lp.logprob == pytest.approx(float(row[prompt[position + 1]]), abs=1e-4)
        assert lp.rank == int((row > row[prompt[position + 1]]).sum()) + 1
        values, ids = row.topk(num_top)
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)
        assert lp.top_token_ids == ids.tolist()


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
def test_prompt_logprobs_equal_transformers_whole_and_chunked(hf_model, model, max_num_batched_tokens: int) -> None:
    prompts = prompts_of(1, [1, 2, 9, 33])
    engine = in_process_engine(*model, num_blocks=64, max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=4)
    outs = run(engine, prompts, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        check(hf_model, prompt, out, 3)
        assert len(out.token_ids) == 3
    if max_num_batched_tokens == 7:
        assert engine.num_steps > 45 // 7  # the prompts really went in chunks


def test_score_only_generates_nothing(hf_model, model) -> None:
    [prompt] = prompts_of(2, [20])
    engine = in_process_engine(*model, num_blocks=32)
    [out] = run(engine, [prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))
    check(hf_model, prompt, out, 0)
    assert out.token_ids == [] and out.finish_reason == "length"
    general = engine.memory.block_manager.stats().general
    assert general.num_free_blocks + general.num_cached_blocks == 32  # every block back
    engine.memory.block_manager.check_integrity()


def test_no_prefix_cache_read_for_scoring_requests(hf_model, model) -> None:
    [prompt] = prompts_of(3, [30])
    engine = in_process_engine(*model, num_blocks=64, block_size=4)
    [first] = run(engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0))
    [scored] = run(engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    [again] = run(engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == 29
    check(hf_model, prompt, scored, 1)
    assert again.num_cached_tokens == 28  # the others still share the cached prefix
    assert first.token_ids == scored.token_ids == again.token_ids


def test_preemption_scores_each_token_once(hf_model, model) -> None:
    prompts = prompts_of(4, [26, 27, 25, 24])
    # 20 blocks of 4 tokens: four sequences of ~26 + 12 tokens cannot all hold their blocks at once.
    engine = in_process_engine(*model, num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    outs = run(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check(hf_model, prompt, out, 2)


def test_bounds_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(InvalidArgument, match="max_tokens"):
        SamplingParams(max_tokens=0)  # only with prompt_logprobs
    with pytest.raises(InvalidArgument, match="^n must be 1"):
        SamplingParams(max_tokens=0, prompt_logprobs=0, n=2)
