"""Argument checks shared by every implementation of the kernels API.

The checks look at shapes, dtypes, devices and strides only, never at tensor values: reading a
value of a CUDA tensor would synchronise the device on every call of the hot path. Value-level
checks (a sequence shorter than its new tokens, a slot out of range) belong to the callers'
invariants; the reference implementation checks some of them because it reads the values anyway.
"""

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        _fail(f"{name} must have a contiguous last dimension, got strides {tuple(tensor.stride())}")


def _check_index(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dtype not in INDEX_DTYPES:
        _fail(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != ndim:
        _fail(f"{name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        _fail(f"all tensors must be on one device, got {devices}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Check a pair of layer caches `(num_blocks, block_size, H_kv, D)`."""
    if k_cache.dim() != 4:
        _fail(f"k_cache must be (num_blocks, block_size, H_kv, D), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in SUPPORTED_DTYPES:
        _fail(f"k_cache dtype {k_cache.dtype} is not one of {SUPPORTED_DTYPES}")
    if v_cache.dtype != k_cache.dtype:
        _fail(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    _check_last_dim_contiguous("k_cache", k_cache)
    _check_last_dim_contiguous("v_cache", v_cache)


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments of `write_kv` fit its contract."""
    check_cache(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        _fail(f"key must be (T, {num_kv_heads}, {head_dim}) to match the cache, got {tuple(key.shape)}")
    if value.shape != key.shape:
        _fail(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        _fail(f"key/value dtypes {key.dtype}/{value.dtype} differ from the cache dtype {k_cache.dtype}")
    _check_last_dim_contiguous("key", key)
    _check_last_dim_contiguous("value", value)
    _check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    _check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def check_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments of `paged_attention` fit its contract."""
    check_cache(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        _fail(f"query must be (T, H_q, {head_dim}) to match the cache, got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads != 0:
        _fail(f"query heads ({query.shape[1]}) must be a multiple of the KV heads ({num_kv_heads})")
    if query.dtype != k_cache.dtype:
        _fail(f"query dtype {query.dtype} differs from the cache dtype {k_cache.dtype}")
    _check_last_dim_contiguous("query", query)
    _check_index("block_tables", block_tables, 2)
    _check_index("seq_lens", seq_lens, 1)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1)
    _check_last_dim_contiguous("block_tables", block_tables)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        _fail(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        _fail(f"cu_seqlens_q must have {num_seqs + 1} entries (B + 1), got {cu_seqlens_q.shape[0]}")
    _check_same_device(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
    )
