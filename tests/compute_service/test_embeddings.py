"""Embeddings in the engine (issue 42 item 2; in process, the tiny random Llama): a prefill-only
request whose answer is the final normed hidden state at the last prompt position, or averaged over
the prompt, L2-normalized, equal to transformers' whole or chunked, batched beside generating
requests, after preemption, never read from the prefix cache, and its blocks all given back."""

from __future__ import annotations

import pytest
import torch

from compute_service.engine.sampling_params import SamplingParams
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


def test_batched_with_generation_after_preemption_and_without_cache_reads(hf_model, model) -> None:
    prompts = prompts_of(6, [26, 27, 25, 24])
    engine = in_process_engine(*model, num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outs = run(engine, prompts[2:] + prompts[:1], SamplingParams(max_tokens=0, pooling="mean"))
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts[2:] + prompts[:1], outs):
        assert torch.tensor(out.embedding) == pytest.approx(hf_embedding(hf_model, prompt, "mean"), abs=1e-5)
    # prompts[0] was computed (and its blocks published) by its generation: the embedding read none.
    assert outs[-1].num_cached_tokens == 0


def test_bounds_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match="^pooling must be one of last, mean"):
        SamplingParams(max_tokens=0, pooling="max")
    with pytest.raises(InvalidArgument, match="^pooling: an embedding generates nothing"):
        SamplingParams(max_tokens=2, pooling="last")
    with pytest.raises(InvalidArgument, match="^pooling"):
        SamplingParams(max_tokens=0, pooling="last", logprobs=1)
