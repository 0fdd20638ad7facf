"""The engine on the real default model (SmolLM2-135M-Instruct, float32 on CPU) against transformers.

16 varied prompts x 32 new tokens, greedy, token for token, in every scheduling regime: prefix
caching on and off, chunked prefill, a pool so small that preemption happens, and requests
arriving while others decode. transformers' outputs are computed once per module, and the model is
loaded into an engine twice (each run asserts that its regimes really happened).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from compute_service import LLM, SamplingParams
from compute_service.engine.outputs import RequestOutput, collect

# The real model on a busy 2-core machine can take far longer than the 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a block manager do in an inference server?",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the mountains,",
    "1, 1, 2, 3, 5, 8,",
    "The three laws of thermodynamics are",
    "PagedAttention splits the KV cache into",
    "import numpy as np\nx = np.arange(10)\n",
    "Dear hiring manager, I am writing to",
]


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    tok = default_model.tokenizer
    chats = []
    for question in QUESTIONS:  # a shared system prompt: repeated prefixes for the prefix cache
        ids = tok.apply_chat_template(
            [{"role": "system", "content": "You are a concise, helpful assistant."},
             {"role": "user", "content": question}],
            add_generation_prompt=True, tokenize=True,
        )
        chats.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return chats + [tok.encode(text) for text in RAW]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]], default_hf_model) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = default_hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                            do_sample=False)
            outs.append(out[0, len(prompt):].tolist())
    return outs


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def run_staggered(llm: LLM, prompts: list[list[int]], every: int) -> dict[str, list[int]]:
    """Add one request every `every` steps while the earlier ones decode; returns token ids by id."""
    engine = llm.engine
    done: dict[str, list[int]] = {}
    results: dict[str, RequestOutput] = {}
    for tick in range(100_000):
        if tick % every == 0 and tick // every < len(prompts):
            engine.add_request(f"r{tick // every}", prompts[tick // every], GREEDY)
        done.update({o.request_id: o.token_ids for o in collect(results, engine.step())})
        if len(done) == len(prompts):
            return done
    raise AssertionError("requests did not finish")


# Two runs cover the five regimes (each run asserts that its regimes really happened), so the
# real model's tests stay within the suite's time budget on two cores.


@pytest.fixture(scope="module")
def llm_without_prefix_caching() -> Iterator[LLM]:
    """Chunked prefill (32 tokens a step), no prefix caching; shared by the tests that do not need
    a pool of their own."""
    with LLM("default", dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=32,
             max_num_seqs=16) as llm:
        yield llm


def test_prefix_caching_preemption_and_late_arrivals(prompts, reference) -> None:
    # 24 blocks of 16 tokens cannot hold 16 requests of ~5-33 + 32 tokens (59 blocks), even
    # staggered: preemption must happen.
    with LLM("default", dtype="float32", enable_prefix_caching=True, max_num_blocks=24) as llm:
        done = run_staggered(llm, prompts, every=2)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.memory_stats().prefix_cache_hits > 0  # the shared system prompt
        assert llm.engine.num_steps > 2 * len(prompts)  # arrivals were spread over decoding steps
    for i, want in enumerate(reference):
        assert done[f"r{i}"] == want, f"prompt {i} differs"


def test_no_prefix_caching_and_chunked_prefill(prompts, reference, llm_without_prefix_caching: LLM) -> None:
    llm = llm_without_prefix_caching
    outs = llm.generate(prompts, GREEDY)
    stats = llm.memory_stats()
    longest = max(len(p) for p in prompts)
    assert longest > 32  # so at least one prompt went in several chunks
    assert stats.prefix_cache_hits == 0 and all(o.num_cached_tokens == 0 for o in outs)
    for i, (out, want) in enumerate(zip(outs, reference)):
        assert out.token_ids == want, f"prompt {i} differs"


def test_paris(llm_without_prefix_caching: LLM) -> None:
    out = llm_without_prefix_caching.chat([{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=20, temperature=0.0)
    assert "Paris" in out.text
    assert out.finish_reason in ("eos", "length")
