"""Typed, validated configuration of the compute engine."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.dtypes import DTYPES


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling budgets and the KV pool the engine asks its memory service for.

    When ``memory_socket`` is None the engine starts a private memory service with the pool
    settings below; otherwise it attaches to that service and those settings are the service's.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None  # default: the memory service's sizing (memory_service/config.py)
    max_num_blocks: int | None = None
    memory_utilization_threshold: float = 0.9
    reserved_fraction: float = 0.0
    reserved_min_priority: int = 1
    # Admissions leave this fraction of the (unreserved) pool free for running sequences to grow
    # into, so that a saturated engine seldom preempts (and recomputes); see scheduler.py.
    admission_watermark: float = 0.05
    memory_socket: str | None = None
    device: str | None = None  # default: cuda when available, else cpu
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError(f"admission_watermark must be in [0, 1), got {self.admission_watermark}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
