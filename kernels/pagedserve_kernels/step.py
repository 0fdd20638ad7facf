"""The per-step kernels a decoder layer calls, behind one interface (`StepKernels`).

`kernels.plan_step` picks the implementation once per step: the fused CPU kernels
(`kernels.cpu_attention.CpuAttentionPlan`: C++ paged attention over the pool in place, rotary in
place on the QKV output, add+RMSNorm and SiLU-mul in one pass each) where they apply, else
`TorchStep` below (PyTorch ops; attention through `write_kv` / `paged_attention`, which run the
Triton kernels on CUDA and the PyTorch reference elsewhere). The model never names either.

Both take the residual stream in float32 (the model keeps it so whatever its weights' dtype, unlike
transformers, which keeps it in the model's dtype) and compute norms and rotary angles in
float32; a norm's output, the next linear's input, takes the weights' dtype.

`run_layers` runs the whole layer stack in one call where an implementation can (the fused CPU
path: one C++ entry for every layer, the same kernels in the same order); None tells the model to
call its layers one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerStack:
    """A model's decoder layers as flat lists, for `StepKernels.run_layers` (built once per model).

    Attributes:
        weights: per layer, in order: input norm (H,), qkv ((Q + 2 KV, H)), o, post-attention norm (H,),
            gate_up, down: the plain weights (empty where released for their packed copy; on an AMX
            CPU in the tiles' layout, `cpu_linear.small_weight`).
        packed: per layer the qkv, o, gate_up and down `kernels.prepack` copies, None where not packed
            (or kept quantized).
        biases: per layer the qkv, o, gate_up and down biases, None where the model has none.
        small_rows: steps of up to this many rows take the small-batch linear (`cpu_linear.small_rows`).
        num_q_heads, num_kv_heads, head_dim: the attention's shape.
        eps: both norms' epsilon; scale: the attention's softmax scale.
        quantized: some projections are kept quantized (`quant.QuantizedLinear`).
        quant, quant_meta, quant_tiles: those projections as the C++ stack takes them
            (`quant.stack_operands`); quant_meta empty where it cannot (then the layers run one by
            one, through `cpu_linear.linear`).
    """

    weights: list[torch.Tensor]
    packed: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]
    small_rows: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    quantized: bool = False
    quant: list[torch.Tensor | None] = field(default_factory=list)
    quant_meta: list[int] = field(default_factory=list)
    quant_tiles: bool = False


class StepKernels(Protocol):
    """What one model step runs per layer, over a packed batch of T tokens."""

    name: str  # "fused-cpu" or "torch": which implementation (logs, tests, benchmarks)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """(T, H) -> (T, H): x / rms(x) * weight (statistics in float32)."""
        ...

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x in place (contiguous, (T, H)); returns rms_norm(residual)."""
        ...

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (T, (H_q + 2 H_kv) D) rows [q | k | v] (may be rotated in place); cos, sin (T, D) float32.

        Returns:
            q (T, H_q, D), k (T, H_kv, D) rotated; v (T, H_kv, D); any row stride.
        """
        ...

    def write_and_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Write the step's K/V into the layer's caches, then attend (see `kernels.paged_attention`).

        Args:
            query: (T, H_q, D); key, value: (T, H_kv, D), any row stride.
            k_cache, v_cache: (num_blocks, block_size, H_kv, D), the layer's caches.
        Returns:
            (T, H_q, D).
        """
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2I) rows [gate | up] -> (T, I) silu(gate) * up."""
        ...

    def run_layers(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_pool: torch.Tensor,
                   stack: LayerStack) -> torch.Tensor | None:
        """Every layer of the step at once, where this implementation can: the result of calling each
        layer in turn (DecoderLayer.forward), bit for bit.

        Args:
            residual: (T, H) the embeddings, contiguous; the residual stream, updated in place.
            cos, sin: (T, D) float32; kv_pool: (num_layers, 2, num_blocks, block_size, H_kv, D).
        Returns:
            the last layer's MLP output (T, H) (the stack's output is residual + it), or None, changing
            nothing: call the layers one by one.
        """
        ...


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight with the statistics in float32, cast to the weight's dtype before the weight
    (transformers' order); x may be the float32 residual stream of a bfloat16 model."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(weight.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + D/2]) of every head; x (T, H, D), cos/sin (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)  # (T, H, D/2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # (T, H, D)
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]  # (T, 1, D)
    return x * cos + rotated * sin


class TorchStep:
    """PyTorch ops (any device and dtype): the path where the fused CPU kernels do not apply.

    Args:
        slot_mapping, block_tables, seq_lens, cu_seqlens_q: the step's index tensors (ForwardBatch).
    """

    name = "torch"

    def __init__(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor) -> None:
        self.slot_mapping, self.block_tables = slot_mapping, block_tables
        self.seq_lens, self.cu_seqlens_q = seq_lens, cu_seqlens_q

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_torch(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        residual.add_(x)
        return rms_norm_torch(residual, weight, eps)

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = apply_rotary(q.view(num_tokens, num_q_heads, head_dim), cos, sin)  # (T, H_q, D)
        k = apply_rotary(k.view(num_tokens, num_kv_heads, head_dim), cos, sin)  # (T, H_kv, D)
        return q, k, v.view(num_tokens, num_kv_heads, head_dim)

    def write_and_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        from pagedserve_kernels import paged_attention, write_kv  # the package's device dispatch

        write_kv(key, value, k_cache, v_cache, self.slot_mapping)
        return paged_attention(query, k_cache, v_cache, self.block_tables, self.seq_lens, self.cu_seqlens_q,
                               scale=scale)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
        return F.silu(gate) * up

    def run_layers(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_pool: torch.Tensor,
                   stack: LayerStack) -> torch.Tensor | None:
        return None  # layer by layer
