"""The serving benchmark's requests: a seeded mix of prompt and output lengths, a shared-prefix
workload, and Poisson arrival times.

Prompts are text (the gateway tokenizes them, as it does for every client), made of common English
words so that any tokenizer turns them into ordinary tokens. Their token length is set through the
tokenizer's tokens-per-word ratio, measured once over the gateway's Tokenize RPC: close to the
target, not exact; the exact prompt lengths come back in each reply's usage and are reported.
Output lengths are exact: every request sets ``ignore_eos`` and ``max_tokens``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Common words, one or two tokens each in byte-level BPE vocabularies.
WORDS = (
    "the of and to in is it that for on was with as at by this from have not are but be or an they "
    "which one you all were her she there would their we him been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three house river garden window market city road light water music story"
).split()


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt text, the exact number of tokens to generate, and how to pick them."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0  # greedy (the random-word mix); the realistic workload samples
    top_p: float = 1.0


def make_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` seeded random words joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def words_for(num_tokens: int, tokens_per_word: float) -> int:
    """Words that make about ``num_tokens`` tokens (at least one)."""
    return max(1, round(num_tokens / tokens_per_word))


def make_requests(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  tokens_per_word: float, seed: int) -> list[RequestSpec]:
    """The rate sweep's mix: prompt and output lengths drawn uniformly from the given ranges
    (inclusive, in tokens), every prompt different."""
    rng = random.Random(seed)
    specs = []
    for _ in range(num_requests):
        num_prompt = rng.randint(*prompt_len)
        specs.append(RequestSpec(make_text(rng, words_for(num_prompt, tokens_per_word)), rng.randint(*output_len)))
    return specs


def make_realistic_requests(tokenizer, num_requests: int, seed: int) -> list[RequestSpec]:
    """The realistic mix (benchmarks/throughput/realistic.py: English chat turns, prompts ~50-1,500
    tokens, outputs 30-400, temperature 0.8, top_p 0.95), each prompt the chat-templated text of
    its turn, as ``vllm bench serve`` sends a custom dataset's prompts."""
    from benchmarks.throughput import realistic

    return [RequestSpec(realistic.chat_text(tokenizer, turn.content), turn.max_tokens, realistic.TEMPERATURE,
                        realistic.TOP_P) for turn in realistic.make_realistic_turns(tokenizer, num_requests, seed)]


def make_shared_prefix(num_requests: int, prefix_tokens: int, question_tokens: int, max_tokens: int,
                       tokens_per_word: float, seed: int) -> list[RequestSpec]:
    """A long common system prompt followed by short distinct questions (numbered, so no two
    share more than the system prompt)."""
    rng = random.Random(seed + 1)
    system = "You are a helpful assistant. Context: " + make_text(rng, words_for(prefix_tokens, tokens_per_word))
    return [RequestSpec(f"{system}\nQuestion {i}: {make_text(rng, words_for(question_tokens, tokens_per_word))}?",
                        max_tokens) for i in range(num_requests)]


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of ``rate`` requests per second
    (exponential gaps, the first request at 0); ``inf`` sends every request at once."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times
