"""The realistic workload of bench_throughput: English chat prompts of ShareGPT-like lengths, sampled."""

from __future__ import annotations

import statistics

from benchmarks.serving.workload import make_realistic_requests
from benchmarks.throughput.realistic import (
    TEMPERATURE, TOP_P, chat_text, make_realistic_turns, make_realistic_workload,
)
from compute_service.model.model_loader import load_tokenizer, resolve_model


def test_prompts_are_english_chat_turns_with_sharegpt_like_lengths() -> None:
    tokenizer = load_tokenizer(resolve_model("default").path)
    workload = make_realistic_workload(tokenizer, 24, seed=3)
    assert workload == make_realistic_workload(tokenizer, 24, seed=3)  # seeded
    prompt_lens = [len(r.prompt_token_ids) for r in workload]
    assert all(40 <= n <= 1560 for n in prompt_lens) and 250 < statistics.median(prompt_lens) < 700
    assert all(30 <= r.max_tokens <= 400 for r in workload)
    assert {(r.temperature, r.top_p) for r in workload} == {(TEMPERATURE, TOP_P)}
    text = tokenizer.decode(workload[0].prompt_token_ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert sum(word in text for word in (" the ", " a ", " is ", " of ")) >= 3  # English prose


def test_serving_requests_are_the_same_turns_as_chat_text() -> None:
    """bench_serving's realistic requests: the text of the offline workload's prompts, sampled alike."""
    tokenizer = load_tokenizer(resolve_model("default").path)
    specs = make_realistic_requests(tokenizer, 6, seed=5)
    workload = make_realistic_workload(tokenizer, 6, seed=5)
    assert [tokenizer(s.prompt, add_special_tokens=False).input_ids for s in specs] == [
        r.prompt_token_ids for r in workload]
    assert [s.max_tokens for s in specs] == [r.max_tokens for r in workload]
    assert {(s.temperature, s.top_p) for s in specs} == {(TEMPERATURE, TOP_P)}
    turns = make_realistic_turns(tokenizer, 6, seed=5)  # vllm bench serve's dataset: before the template
    assert [chat_text(tokenizer, t.content) for t in turns] == [s.prompt for s in specs]
