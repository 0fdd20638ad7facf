"""Triton kernel that scatters new tokens' K/V into the paged caches, and its launcher."""

import torch
import triton
import triton.language as tl

from pagedserve_kernels._validate import check_write_kv
from pagedserve_kernels.triton_common import check_triton_device


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    # One program copies one token: (H_kv, D) of K and of V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, H_PAD)  # (H_PAD,)
    dims = tl.arange(0, D_PAD)  # (D_PAD,)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)  # (H_PAD, D_PAD)

    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block_id * stride_kc_block + offset * stride_kc_slot
    tl.store(k_dst + heads[:, None] * stride_kc_head + dims[None, :], key, mask=mask)

    value = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask)
    v_dst = v_cache_ptr + block_id * stride_vc_block + offset * stride_vc_slot
    tl.store(v_dst + heads[:, None] * stride_vc_head + dims[None, :], value, mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton `write_kv`: scatter (T, H_kv, D) key/value into the caches at `slot_mapping`, in place.

    Args and errors as `kernels.write_kv`; tensors must be on CUDA (or on CPU under TRITON_INTERPRET=1).
    """
    check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    check_triton_device(key)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )
