"""Builders of paged batches for the kernel tests (test code: it lives here, not in the product package).

`make_paged_batch` draws contiguous per-sequence K/V, writes them into a pool whose blocks are
handed out in a shuffled order (so block tables are not sorted), and keeps the contiguous copies so
that results can be checked against plain dense attention.
"""

import itertools
import math
from dataclasses import dataclass

import torch

from pagedserve_kernels.reference import write_kv_reference


@dataclass
class PagedBatch:
    """A packed batch of new tokens plus the paged KV cache they attend to."""

    query: torch.Tensor  # (T, H_q, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, H_kv, D)
    v_cache: torch.Tensor  # (num_blocks, block_size, H_kv, D)
    block_tables: torch.Tensor  # (B, max_blocks_per_seq) int32
    seq_lens: torch.Tensor  # (B,) int32
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    keys: list[torch.Tensor]  # per sequence (S_b, H_kv, D), contiguous
    values: list[torch.Tensor]  # per sequence (S_b, H_kv, D), contiguous

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of `paged_attention`."""
        return self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.cu_seqlens_q

    def to(self, device: str | torch.device) -> "PagedBatch":
        """A copy of the batch on another device."""
        return PagedBatch(
            *(t.to(device) for t in self.args()),
            keys=[k.to(device) for k in self.keys],
            values=[v.to(device) for v in self.values],
        )


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_spare_blocks: int = 3,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> PagedBatch:
    """Build a random paged batch: sequence b has seq_lens[b] tokens, the last q_lens[b] of them new.

    Block tables are padded with block 0 (as the contract says) and blocks are assigned in a random
    order; `num_spare_blocks` unused blocks are left in the pool. Unused slots hold zeros.
    """
    if len(seq_lens) != len(q_lens) or any(q > s for s, q in zip(seq_lens, q_lens)):
        raise ValueError(f"each q_len must be <= its seq_len: {seq_lens} vs {q_lens}")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(1, max(blocks_per_seq, default=1)), dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(cache_shape, dtype=dtype)
    v_cache = torch.zeros(cache_shape, dtype=dtype)
    keys, values = [], []
    taken = iter(order)
    for b, seq_len in enumerate(seq_lens):
        table = [next(taken) for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)  # (S, H_kv, D)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)],
                             dtype=torch.int64)
        write_kv_reference(key, value, k_cache, v_cache, slots)
        keys.append(key)
        values.append(value)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)  # (T, H_q, D)
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    batch = PagedBatch(query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                       cu_seqlens_q, keys, values)
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def dense_attention(batch: PagedBatch, scale: float | None = None) -> torch.Tensor:
    """Attention on the contiguous per-sequence K/V of `batch`, in float32; (T, H_q, D) float32.

    Uses no block table at all, so it checks the paging of the other implementations.
    """
    num_q_heads, head_dim = batch.query.shape[1:]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    outputs = []
    cu = batch.cu_seqlens_q.tolist()
    for b, (key, value) in enumerate(zip(batch.keys, batch.values)):
        q = batch.query[cu[b]:cu[b + 1]].float().transpose(0, 1)  # (H_q, q_len, D)
        group = num_q_heads // key.shape[1]
        k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H_q, S, D)
        v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H_q, S, D)
        seq_len, q_len = key.shape[0], q.shape[1]
        causal = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
        scores = (q @ k.transpose(1, 2)) * scale  # (H_q, q_len, S)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        outputs.append((probs @ v).transpose(0, 1))  # (q_len, H_q, D)
    return torch.cat(outputs) if outputs else batch.query.float()
