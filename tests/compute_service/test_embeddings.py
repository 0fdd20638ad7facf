"""Embeddings in the engine (in process, the tiny random Llama): a prefill-only
request whose answer is the final normed hidden state at the last prompt position, or averaged over
the prompt, L2-normalized, equal to transformers' whole or chunked, batched beside generating
requests, preempted mid-pool, read from the prefix cache only with "last" pooling, and its blocks
all given back."""

from __future__ import annotations

import pytest
import torch

from compute_service.engine.outputs import collect
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.scheduler import Scheduler
from compute_service.structured.constraint import Constraint
from pagedserve.errors import InvalidArgument

from tests.compute_service.test_prompt_logprobs import prompts_of, run
from tests.compute_service.tiny_llama import in_process_engine


def hf_embedding(hf_model, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' final normed hidden states (its last_hidden_state), pooled and normalized."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return pooled / pooled.norm()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
def test_embeddings_equal_transformers_whole_and_chunked(hf_model, model, pooling: str,
                                                         max_num_batched_tokens: int) -> None:
    prompts = prompts_of(5, [1, 3, 17, 40])
    engine = in_process_engine(*model, num_blocks=64, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=4)
    outs = run(engine, prompts, SamplingParams(max_tokens=0, pooling=pooling))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == [] and out.finish_reason == "length"
        assert torch.tensor(out.embedding) == pytest.approx(hf_embedding(hf_model, prompt, pooling), abs=1e-5)
    general = engine.memory.block_manager.stats().general
    assert general.num_free_blocks + general.num_cached_blocks == 64  # every block back
    engine.memory.block_manager.check_integrity()


def test_batched_with_generation_and_mean_reads_no_cache(hf_model, model) -> None:
    prompts = prompts_of(6, [26, 27, 25, 24])
    engine = in_process_engine(*model, num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outs = run(engine, prompts[2:] + prompts[:1], SamplingParams(max_tokens=0, pooling="mean"))
    for prompt, out in zip(prompts[2:] + prompts[:1], outs):
        assert torch.tensor(out.embedding) == pytest.approx(hf_embedding(hf_model, prompt, "mean"), abs=1e-5)
    # prompts[0] was computed (and its blocks published) by its generation: the embedding read none.
    assert outs[-1].num_cached_tokens == 0


def test_preempted_mid_pool_recomputes_and_pools_nothing_twice(hf_model, model, monkeypatch) -> None:
    # Three ~30-token mean-pooled prompts and a generation in 10 blocks of 4, 6 tokens a step: the
    # prompts are chunked, the pool runs out, and an embedding is preempted with positions pooled.
    preempted: list[tuple[str, int]] = []  # (request id, its positions pooled when preempted)
    preempt = Scheduler._preempt

    def spy(self, seq, reason, plan=None):
        if seq.params.pooling is not None:
            preempted.append((seq.request_id, seq.num_pooled))
        return preempt(self, seq, reason, plan)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    prompts = prompts_of(7, [30, 29, 31])
    engine = in_process_engine(*model, num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    engine.add_request("g0", prompts_of(8, [6])[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    outs = run(engine, prompts, SamplingParams(max_tokens=0, pooling="mean"))
    assert any(num_pooled > 0 for _, num_pooled in preempted), preempted
    for prompt, out in zip(prompts, outs):
        assert torch.tensor(out.embedding) == pytest.approx(hf_embedding(hf_model, prompt, "mean"), abs=1e-5)
    general = engine.memory.block_manager.stats().general
    assert general.num_free_blocks + general.num_cached_blocks == 10
    engine.memory.block_manager.check_integrity()


def test_last_pooling_reads_the_prefix_cache_mean_does_not(hf_model, model) -> None:
    [prompt] = prompts_of(9, [27])
    engine = in_process_engine(*model, num_blocks=32, block_size=4, max_num_seqs=4)
    engine.add_request("g", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()  # the prompt's 6 full blocks are published
    [last] = run(engine, [prompt], SamplingParams(max_tokens=0, pooling="last"))
    assert last.num_cached_tokens == 24  # (27 - 1) // 4 blocks: the last position is always computed
    assert torch.tensor(last.embedding) == pytest.approx(hf_embedding(hf_model, prompt, "last"), abs=1e-5)
    engine.add_request("m", prompt, SamplingParams(max_tokens=0, pooling="mean"))
    results: dict = {}
    while engine.has_unfinished():
        collect(results, engine.step())
    assert results["m"].num_cached_tokens == 0
    assert torch.tensor(results["m"].embedding) == pytest.approx(hf_embedding(hf_model, prompt, "mean"), abs=1e-5)
    engine.memory.block_manager.check_integrity()


def test_bounds_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match="^pooling must be one of last, mean"):
        SamplingParams(max_tokens=0, pooling="max")
    with pytest.raises(InvalidArgument, match="^pooling: an embedding generates nothing .*got max_tokens 2 with "
                                              "pooling 'last'"):
        SamplingParams(max_tokens=2, pooling="last")
    with pytest.raises(InvalidArgument, match="^pooling: .*got logprobs 1 with pooling 'mean'"):
        SamplingParams(max_tokens=0, pooling="mean", logprobs=1)
    with pytest.raises(InvalidArgument, match="^pooling cannot be combined with json_object: .*got pooling 'last'"):
        SamplingParams(max_tokens=0, pooling="last", constraint=Constraint("json_object"))
