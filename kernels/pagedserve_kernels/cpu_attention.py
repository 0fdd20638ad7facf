"""The fused CPU path (`StepKernels` of kernels/pagedserve_kernels/step.py): the C++ ops of csrc/cpu_ops.cpp.

Attention writes the step's K/V, then attends, without gathering the context. Per step,
`CpuAttentionPlan.build` reads the batch's lengths once (on the host); every layer then writes its
new K/V into the pool (`write_kv_`: one copy per token row) and runs the C++ `paged_attention` op:
it reads K/V blocks in place through the block table (no copy, no padding to the longest
sequence), all query heads of a KV group sharing each block read.

Fresh prompts (no cached context, several new tokens) take the same op where it runs the AVX-512
kernels (csrc/paged_attention_avx512.h): their K/V were just written and are in cache, and its
prompt tiles beat PyTorch's causal SDPA on the default model's prompts (SDPA also needs K/V
expanded per query head and transposed copies per prompt). With the portable kernel (x86-64-v3
builds, other block sizes) SDPA is the faster one for them, so there they still attend to the
step's K/V through SDPA's flash kernel (4-D contiguous
inputs, one KV head per query head: 3-D inputs or `enable_gqa=True` take slower paths).

Results equal `paged_attention_reference` up to float rounding (tests/kernels/test_cpu_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve_kernels import cpu_ops
from pagedserve_kernels.step import LayerStack

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)  # instantiated in csrc/cpu_ops.cpp
DTYPES = (torch.float32, torch.bfloat16)  # of the activations and the KV pool; the ops compute in float32


def covers(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the fused kernels take a model on `device` in `dtype` with heads of `head_dim`."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in SUPPORTED_HEAD_DIMS


@dataclass(frozen=True)
class CpuAttentionPlan:
    """One step's index tensors for the fused CPU path (built once, used by every layer), and its ops.

    Attributes:
        slots: (T,) int64 pool slot of each token's K/V; negative: not written.
        block_tables: (B, max_blocks) int32; seq_lens: (B,) int32; cu_seqlens_q: (B + 1,) int32.
        seq_ids: (B,) int64 all sequences of the step (the op computes the ones it is given).
        fresh: (first row, number of tokens) of each fresh prompt.
        other_seq_ids: (N,) int64 the sequences that are not fresh prompts (the op's share where
            fresh prompts go through SDPA).
    """

    name = "fused-cpu"
    ops: Any
    slots: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_ids: torch.Tensor
    fresh: list[tuple[int, int]]
    other_seq_ids: torch.Tensor

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              cu_seqlens_q: torch.Tensor, *, dtype: torch.dtype, head_dim: int) -> CpuAttentionPlan | None:
        """The plan, or None where the fused path does not apply (not a float32 or bfloat16 CPU
        model, an unsupported head size, or the extension unavailable): then run the PyTorch path."""
        if not covers(slot_mapping.device, dtype, head_dim):
            return None
        ops = cpu_ops.load()
        if ops is None:
            return None
        lens, cu = seq_lens.tolist(), cu_seqlens_q.tolist()
        fresh, other = [], []
        for b, seq_len in enumerate(lens):
            q_len = cu[b + 1] - cu[b]
            if q_len == seq_len and q_len > 1:
                fresh.append((cu[b], q_len))
            else:
                other.append(b)
        return cls(ops=ops, slots=slot_mapping.long().contiguous(),
                   block_tables=block_tables.to(torch.int32).contiguous(), seq_lens=seq_lens.to(torch.int32),
                   cu_seqlens_q=cu_seqlens_q.to(torch.int32),
                   seq_ids=torch.arange(seq_lens.numel(), dtype=torch.int64), fresh=fresh,
                   other_seq_ids=torch.tensor(other, dtype=torch.int64))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return self.ops.add_rms_norm(residual, x, weight, eps)

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q and k in place on the QKV output; returns views of it."""
        num_tokens = qkv.shape[0]
        self.ops.rotary_(qkv, cos, sin, num_q_heads + num_kv_heads, head_dim)
        q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        return (q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
                v.view(num_tokens, num_kv_heads, head_dim))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate_up)

    def run_layers(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_pool: torch.Tensor,
                   stack: LayerStack) -> torch.Tensor | None:
        """All layers in one C++ call (`decoder_layers`: the ops below, layer after layer, without the
        interpreter between them; projections kept quantized through the quantized kernel), unless fresh
        prompts go through SDPA (`write_and_attend`)."""
        if stack.quantized and not stack.quant_meta:
            return None  # a projection of more parts than the C++ stack takes
        if self.fresh and not self.ops.avx512_attention(kv_pool.shape[3]):
            return None
        return self.ops.decoder_layers(residual, None, stack.weights, stack.packed, stack.biases, stack.small_rows,
                                       cos, sin, kv_pool, self.slots,
                                       self.block_tables, self.seq_lens, self.cu_seqlens_q, self.seq_ids,
                                       stack.num_q_heads, stack.num_kv_heads, stack.head_dim, stack.eps, stack.scale,
                                       stack.quant, stack.quant_meta, stack.quant_tiles)

    def write_and_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Write the step's K/V into the layer's caches, then attend.

        Args:
            query: (T, H_q, D); key, value: (T, H_kv, D), any row stride (views into the fused QKV).
            k_cache, v_cache: (num_blocks, block_size, H_kv, D) contiguous, the layer's caches.
        Returns:
            (T, H_q, D) contiguous.
        """
        self.ops.write_kv_(k_cache, v_cache, key, value, self.slots)
        query = query.contiguous()
        out = torch.empty_like(query)
        if not self.fresh or self.ops.avx512_attention(k_cache.shape[1]):
            self.ops.paged_attention(out, query, k_cache, v_cache, self.block_tables, self.seq_lens,
                                     self.cu_seqlens_q, self.seq_ids, scale)
            return out
        if self.other_seq_ids.numel():
            self.ops.paged_attention(out, query, k_cache, v_cache, self.block_tables, self.seq_lens,
                                     self.cu_seqlens_q, self.other_seq_ids, scale)
        group = query.shape[1] // k_cache.shape[2]  # query heads per KV head
        for start, num in self.fresh:
            rows = slice(start, start + num)
            q = query[rows].transpose(0, 1).contiguous()[None]  # (1, H_q, n, D)
            k = key[rows].repeat_interleave(group, dim=1).transpose(0, 1).contiguous()[None]
            v = value[rows].repeat_interleave(group, dim=1).transpose(0, 1).contiguous()[None]
            out[rows] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)
        return out
