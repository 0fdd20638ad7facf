"""Triton write_kv against the PyTorch reference."""

import pytest
import torch

from pagedserve_kernels.reference import write_kv_reference
from pagedserve_kernels.triton_write_kv import write_kv_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(3, 64, 16), (8, 128, 32), (2, 80, 16)])
def test_matches_reference_and_skips_padding(triton_device: str, dtype: torch.dtype, num_kv_heads: int,
                                             head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 20
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)  # (T, H_kv, D)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, k_expected, v_expected, slots)
    k_dev, v_dev = k_cache.to(triton_device), v_cache.to(triton_device)
    write_kv_triton(key.to(triton_device), value.to(triton_device), k_dev, v_dev,
                    slots.to(torch.int32).to(triton_device))
    assert torch.equal(k_dev.cpu(), k_expected) and torch.equal(v_dev.cpu(), v_expected)


def test_writes_into_pool_views_from_strided_key(triton_device: str) -> None:
    pool = torch.zeros(3, 2, 4, 16, 2, 64, device=triton_device)  # (layers, K/V, blocks, bs, H_kv, D)
    qkv = torch.randn(5, 8, 64, device=triton_device)  # (T, H_q + 2 H_kv, D) fused projection
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([0, 17, 63, -1, 40], device=triton_device)
    write_kv_triton(key, value, pool[1, 0], pool[1, 1], slots)
    expected = torch.zeros(2, 4, 16, 2, 64)
    write_kv_reference(key.cpu(), value.cpu(), expected[0], expected[1], slots.cpu())
    assert torch.equal(pool[1].cpu(), expected)
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


def test_rejects_bad_arguments() -> None:
    key = torch.randn(4, 2, 64)
    cache = torch.zeros(3, 16, 2, 64)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="key must be"):
        write_kv_triton(key[:, :1], key[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        write_kv_triton(key.half(), key.half(), cache, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(key, key, cache, cache, slots[:3])
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        write_kv_triton(key, key, cache, cache, slots.float())
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_triton(key.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :64], key, cache, cache, slots)
    with pytest.raises(ValueError, match="k_cache must be"):
        write_kv_triton(key, key, cache[0], cache[0], slots)
