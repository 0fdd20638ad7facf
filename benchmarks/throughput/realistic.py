"""A realistic offline workload: English prompts with a ShareGPT-like length mix, sampled outputs.

Text: the Python documentation's topic pages that CPython ships (`pydoc_data.topics`, ~465k
characters of English prose and examples), so every machine has the same text and nothing is
downloaded. Each prompt is a chat-templated user turn, an instruction followed by an excerpt cut to
the drawn length. Lengths are log-normal like ShareGPT's: prompts median 400 tokens, clipped to
[50, 1500] (mean ~520); outputs median 150, clipped to [30, 400]. Outputs are sampled at
temperature 0.8, top_p 0.95, without seeds (vLLM 0.32's CPU build fails on per-request seeds), and
run to their drawn length (``ignore_eos``), so that two runs or two systems do the same work.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from benchmarks.throughput.workload import Request

TEMPERATURE, TOP_P = 0.8, 0.95
PROMPT_TOKENS = (400, 0.7, 50, 1500)  # log-normal median, sigma, clipped to [low, high]
OUTPUT_TOKENS = (150, 0.7, 30, 400)
_INSTRUCTIONS = (
    "Explain the following documentation to a programmer who is new to Python:",
    "Summarise the following text in a few paragraphs:",
    "Write three exam questions, with answers, about this passage:",
    "What are the most common mistakes people make with what is described below?",
    "Rewrite the following as a short tutorial with examples:",
)


def _lognormal(rng: random.Random, shape: tuple[float, float, int, int]) -> int:
    median, sigma, low, high = shape
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


def english_text() -> str:
    """The topic pages CPython ships, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def chat_text(tokenizer, content: str) -> str:
    """``content`` as one user turn through ``tokenizer``'s chat template, ready for the assistant."""
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def _chat_ids(tokenizer, content: str) -> list[int]:
    return tokenizer(chat_text(tokenizer, content), add_special_tokens=False).input_ids


@dataclass(frozen=True)
class Turn:
    """One realistic request as a client sends it: the user's text and the tokens to generate."""

    content: str  # an instruction and an excerpt, before the chat template
    max_tokens: int


def make_realistic_turns(tokenizer, num_requests: int, seed: int) -> list[Turn]:
    """``num_requests`` user turns whose chat-templated prompts have the length mix above.

    The serving benchmark sends these as text (each server applies the template, or vLLM's client
    does); ``make_realistic_workload`` turns the same turns into token ids.
    """
    rng = random.Random(seed)
    text_ids = tokenizer(english_text(), add_special_tokens=False).input_ids
    turns = []
    for _ in range(num_requests):
        instruction = rng.choice(_INSTRUCTIONS)
        overhead = len(_chat_ids(tokenizer, instruction + "\n\n"))
        excerpt_len = max(8, _lognormal(rng, PROMPT_TOKENS) - overhead)
        start = rng.randrange(0, len(text_ids) - excerpt_len)
        excerpt = tokenizer.decode(text_ids[start:start + excerpt_len])
        turns.append(Turn(f"{instruction}\n\n{excerpt}", _lognormal(rng, OUTPUT_TOKENS)))
    return turns


def make_realistic_workload(tokenizer, num_requests: int, seed: int) -> list[Request]:
    """``num_requests`` chat prompts (token ids through ``tokenizer``'s chat template) with their
    output lengths and sampling settings."""
    return [Request(_chat_ids(tokenizer, turn.content), turn.max_tokens, temperature=TEMPERATURE, top_p=TOP_P)
            for turn in make_realistic_turns(tokenizer, num_requests, seed)]
