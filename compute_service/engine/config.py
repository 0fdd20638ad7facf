"""Typed, validated configuration of the compute engine."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.dtypes import AUTO, ELEMENT_SIZES, QUANTIZATIONS


@dataclass(frozen=True)
class EngineConfig:
    """The engine's scheduling budgets and where its KV blocks live.

    The pool's own settings (size, prefix caching, reserved share) are the memory service's
    (``memory_service.config.MemoryServiceConfig``); ``block_size`` is the layout the engine attaches
    with and must equal the service's. When ``memory_socket`` is None, ``LLM`` starts a private
    memory service for the engine.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # Admissions leave this fraction of the (unreserved) pool free for running sequences to grow
    # into, so that a saturated engine seldom preempts (and recomputes); see scheduler.py.
    admission_watermark: float = 0.05
    # N-gram speculative drafts per greedy decoding sequence and step, at most (0 = off); fewer
    # as the batch grows (compute_service/engine/speculative.py). Outputs are unchanged.
    num_speculative_tokens: int = 4
    # How long a step waits for a constrained sequence's token mask before that request alone
    # fails (finish_reason "error"); see compute_service/structured/logits_mask.py.
    mask_fill_timeout_s: float = 1.0
    # ... and the CPU seconds one mask may take (measured where it is filled, so load does not count).
    mask_fill_max_cpu_s: float = 0.1
    memory_socket: str | None = None
    device: str | None = None  # default: cuda when available, else cpu
    # "auto": bfloat16 on CUDA and on CPUs with native bf16 (AMX-BF16, AVX512-BF16), else float32
    # (pagedserve.dtypes.resolve_auto); a dtype name always wins.
    dtype: str = AUTO
    # "auto": a GGUF file's quantized weights stay quantized, a float checkpoint stays in `dtype`;
    # "none": all widened to `dtype`; "int8" / "int4": quantized at load (CPU only;
    # kernels/pagedserve_kernels/quant.py).
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError(f"admission_watermark must be in [0, 1), got {self.admission_watermark}")
        for name in ("mask_fill_timeout_s", "mask_fill_max_cpu_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dtype != AUTO and self.dtype not in ELEMENT_SIZES:
            raise ValueError(f"dtype must be {AUTO!r} or one of {', '.join(ELEMENT_SIZES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
