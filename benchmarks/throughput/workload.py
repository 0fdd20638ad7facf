"""The throughput benchmark's workload and result types (shared by bench_throughput.py and its helpers)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from compute_service.model.model_config import ModelConfig


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos)
    temperature: float = 0.0  # 0: greedy (the random-id workload); the realistic one samples
    top_p: float = 1.0


def make_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  vocab_size: int, special_ids: set[int], seed: int) -> list[Request]:
    """Uniform prompt and output lengths (inclusive ranges); prompt tokens avoid ``special_ids``."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    return [
        Request([rng.choice(allowed) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(num_requests)
    ]


def seeded_subset(workload: list[Request], num: int | None, seed: int) -> list[Request]:
    """A seeded sample of ``num`` requests (all when None), in arrival order."""
    if num is None or num >= len(workload):
        return list(workload)
    keep = sorted(random.Random(seed + 1).sample(range(len(workload)), num))
    return [workload[i] for i in keep]


def warmup_prompt(workload: list[Request]) -> list[int]:
    """8 copies of one token: warms a system up without sharing a prefix with any request."""
    return [workload[0].prompt_token_ids[0]] * 8


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize


@dataclass
class RunResult:
    """One system's run: ``outputs[i]`` are the tokens generated for its i-th request."""

    name: str
    num_requests: int
    generated_tokens: int
    wall_s: float
    outputs: list[list[int]]
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.wall_s
