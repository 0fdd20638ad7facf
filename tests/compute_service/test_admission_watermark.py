"""The admission watermark: a saturated engine keeps room for its running sequences to grow, so it
preempts (and recomputes) less, and its greedy tokens do not change."""

from __future__ import annotations

import random

import pytest

from compute_service import LLM, SamplingParams
from compute_service.engine.config import EngineConfig


def run(model_dir: str, watermark: float) -> tuple[list[list[int]], int]:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(4, 24))] for _ in range(12)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # 40 blocks of 4 tokens for 12 sequences of up to 24 + 16 tokens: saturated.
    with LLM(model_dir, dtype="float32",
             block_size=4, max_num_blocks=40, max_num_seqs=12, admission_watermark=watermark) as llm:
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], llm.engine.scheduler.num_preemptions


def test_watermark_cuts_preemptions_without_changing_tokens(make_tiny_model) -> None:
    model_dir = str(make_tiny_model("llama").path)
    tokens_without, preemptions_without = run(model_dir, 0.0)
    tokens_with, preemptions_with = run(model_dir, 0.2)
    assert preemptions_without > 0
    assert preemptions_with < preemptions_without
    assert tokens_with == tokens_without


def test_watermark_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="admission_watermark"):
        EngineConfig(admission_watermark=1.0)
    with pytest.raises(ValueError, match="admission_watermark"):
        EngineConfig(admission_watermark=-0.1)
