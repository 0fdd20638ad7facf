"""Triton paged attention over a packed variable-length batch, and its launcher.

One kernel serves decode, prefill and chunked prefill. A program owns one tile of a sequence's new
tokens (BLOCK_Q tokens times the G query heads that share one KV head, so K/V are loaded once per
group) and walks that sequence's context in BLOCK_N-token steps: logical positions are translated
to physical slots through the block table, K/V are loaded from the scattered blocks, and an online
softmax (running max and sum, fp32) folds each step into the accumulator in a single pass.

For long contexts at small batch there are too few tiles to fill the device, so the context is
also split into NUM_SPLITS ranges (flash-decoding): each program writes a normalised partial
output and its log-sum-exp, and `_merge_splits_kernel` combines them exactly.
"""

import math

import torch
import triton
import triton.language as tl

from pagedserve_kernels._validate import check_paged_attention
from pagedserve_kernels.triton_common import check_triton_device, is_interpreter, num_compute_units

LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    out_ptr, lse_ptr,
    scale_log2, num_seqs, group_size, head_dim, split_len,
    stride_q_t, stride_q_h,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_bt,
    stride_o_split, stride_o_t, stride_o_h,
    stride_lse_split, stride_lse_t,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, B_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    IS_FP32: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Which sequence owns this tile: sequence b's tiles start at cu[b] // BLOCK_Q + b, a strictly
    # increasing sequence, so b is the number of starts <= tile, minus one.
    seq_ids = tl.arange(0, B_PAD)  # (B_PAD,)
    cu_starts = tl.load(cu_seqlens_q_ptr + seq_ids, mask=seq_ids < num_seqs, other=0)  # (B_PAD,)
    is_before = (cu_starts // BLOCK_Q + seq_ids <= tile) & (seq_ids < num_seqs)
    seq = tl.sum(is_before.to(tl.int32), axis=0) - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_lo = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of the tile
    if q_lo >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len

    # Rows of the tile: token-major, query head of the group minor.  (BLOCK_M = BLOCK_Q * G_PAD)
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tokens = q_lo + rows // G_PAD  # (BLOCK_M,) index among the new tokens
    q_heads = kv_head * group_size + rows % G_PAD  # (BLOCK_M,)
    is_row = (tokens < q_len) & (rows % G_PAD < group_size)  # (BLOCK_M,)
    positions = num_cached + tokens  # (BLOCK_M,) absolute position of each row's token
    dims = tl.arange(0, D_PAD)  # (D_PAD,)
    is_dim = dims < head_dim

    q_rows = (q_start + tokens).to(tl.int64) * stride_q_t + q_heads * stride_q_h  # (BLOCK_M,)
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=is_row[:, None] & is_dim[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)  # (BLOCK_M, D_PAD)

    # Context this tile sees: up to its last token's position (causal), restricted to this split.
    kv_end = num_cached + tl.minimum(q_lo + BLOCK_Q, q_len)
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)  # running sum of p @ V
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    for start in range(kv_lo, kv_hi, BLOCK_N):
        ctx = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical positions
        is_ctx = ctx < kv_hi
        # Address translation: logical block -> physical block -> slot.
        block_ids = tl.load(table_row + ctx // BLOCK_SIZE, mask=is_ctx, other=0).to(tl.int64)
        offsets = ctx % BLOCK_SIZE
        k_ptrs = k_head + block_ids[None, :] * stride_k_block + offsets[None, :] * stride_k_slot + dims[:, None]
        k = tl.load(k_ptrs, mask=is_dim[:, None] & is_ctx[None, :], other=0.0)  # (D_PAD, BLOCK_N)
        v_ptrs = v_head + block_ids[:, None] * stride_v_block + offsets[:, None] * stride_v_slot + dims[None, :]
        v = tl.load(v_ptrs, mask=is_ctx[:, None] & is_dim[None, :], other=0.0)  # (BLOCK_N, D_PAD)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        if IS_FP32 or UPCAST_DOT:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * scale_log2  # (BLOCK_M, BLOCK_N), log2 units
        is_visible = (ctx[None, :] <= positions[:, None]) & is_ctx[None, :]
        scores = tl.where(is_visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # (BLOCK_M,)
        # Rows with nothing visible yet keep m = -inf; shift them by 0 so that exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)  # (BLOCK_M,) rescales what was accumulated so far
        p = tl.exp2(scores - m_shift[:, None])  # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Probabilities are rounded to the V dtype for the tensor-core product, sums stay fp32.
        p = p.to(v_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            p = p.to(tl.float32)
        if IS_FP32 or UPCAST_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    is_seen = l_i > 0.0
    out = acc / tl.where(is_seen, l_i, 1.0)[:, None]  # (BLOCK_M, D_PAD); rows that saw nothing are 0
    out_rows = split * stride_o_split + (q_start + tokens).to(tl.int64) * stride_o_t + q_heads * stride_o_h
    out_mask = is_row[:, None] & is_dim[None, :]
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    if NUM_SPLITS > 1:
        lse = tl.where(is_seen, m_i + tl.log2(tl.where(is_seen, l_i, 1.0)), float("-inf"))  # (BLOCK_M,)
        lse_rows = split * stride_lse_split + (q_start + tokens).to(tl.int64) * stride_lse_t + q_heads
        tl.store(lse_ptr + lse_rows, lse, mask=is_row)


@triton.jit
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, head_dim,
    stride_p_split, stride_p_t, stride_p_h,
    stride_lse_split, stride_lse_t,
    stride_o_t, stride_o_h,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    # One program merges the NUM_SPLITS partial outputs of one (token, query head):
    # out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m), exact since each o_s is normalised.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, S_PAD)  # (S_PAD,)
    is_split = splits < NUM_SPLITS
    lse = tl.load(lse_ptr + splits * stride_lse_split + token * stride_lse_t + head, mask=is_split,
                  other=float("-inf"))  # (S_PAD,)
    m = tl.max(lse, axis=0)
    weights = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # (S_PAD,), 0 for empty splits
    dims = tl.arange(0, D_PAD)
    p_ptrs = partial_ptr + splits[:, None] * stride_p_split + token * stride_p_t + head * stride_p_h + dims[None, :]
    partials = tl.load(p_ptrs, mask=is_split[:, None] & (dims[None, :] < head_dim), other=0.0)  # (S_PAD, D_PAD)
    out = tl.sum(partials * weights[:, None], axis=0) / tl.sum(weights, axis=0)  # (D_PAD,)
    o_ptrs = out_ptr + token * stride_o_t + head * stride_o_h + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 256  # below this a split's K/V load does not pay for its merge


def choose_num_splits(num_tiles: int, num_kv_heads: int, max_context: int, num_units: int) -> int:
    """Split-KV heuristic, from shapes only (no device sync).

    Splits when the tiles x KV heads grid would leave the device under-filled (fewer than two
    programs per compute unit) and the context bound is long enough for every split to keep at
    least MIN_SPLIT_TOKENS tokens.
    """
    num_programs = num_tiles * num_kv_heads
    target = 2 * num_units
    if num_programs >= target:
        return 1
    wanted = -(-target // num_programs)
    return max(1, min(wanted, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton `paged_attention`. Arguments, result and errors as `kernels.paged_attention`.

    Args:
        num_splits: split the context into this many ranges (1 = no split); default: heuristic.
        block_q: new tokens per tile (power of two); a tile has block_q * next_pow2(G) rows;
            default: 16 rows when T == B (decode-like batches), else 64 rows.
        block_n: context tokens per step (power of two); default 64 (32 for float32).
        num_warps: warps per program of the attention kernel; default 8 for 64-row tiles, else 4.
    Defaults keep the sm_90 build free of register spills (checked by tests/kernels/test_triton_compile.py).
    The grid is sized from shapes alone (no device sync, so the call can be captured in a CUDA
    graph): T // block_q + B tiles bound every sequence's tiles, and the split heuristic takes
    `max_blocks_per_seq * block_size` as the context bound, so block tables should be trimmed to
    the batch's longest sequence.
    """
    check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    check_triton_device(query)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} is larger than the supported 256")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group_size = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group_size)
    if block_q is None:
        # tl.dot needs >= 16 rows; decode-like batches use the fewest tokens that give 16 rows.
        rows = 16 if num_tokens == num_seqs else 64
        block_q = max(1, rows // g_pad)
    if block_n is None:  # fp32 dots run on FMA units and need more registers per element
        block_n = 32 if query.dtype == torch.float32 else 64
    if num_warps is None:
        num_warps = 8 if block_q * g_pad >= 64 else 4
    for name, value in (("block_q", block_q), ("block_n", block_n)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block_q * g_pad < 16 or block_n < 16:
        raise ValueError(f"tiles need >= 16 rows and columns, got {block_q * g_pad} x {block_n}")
    num_tiles = num_tokens // block_q + num_seqs
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles, num_kv_heads, max_context, num_compute_units(query.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_len = -(-max(max_context, 1) // num_splits)
    split_len = -(-split_len // block_n) * block_n  # whole steps per split
    num_splits = -(-max(max_context, 1) // split_len)
    if num_splits > 1:
        partial = torch.empty((num_splits, *query.shape), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=query.device)
        target, lse_strides = partial, (lse.stride(0), lse.stride(1))
    else:
        partial, lse, target, lse_strides = None, out, out, (0, 0)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    is_fp32 = query.dtype == torch.float32
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
        target, lse,
        scale * LOG2_E, num_seqs, group_size, head_dim, split_len,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        target.stride(0) if num_splits > 1 else 0, target.stride(-3), target.stride(-2),
        *lse_strides,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, G_PAD=g_pad, BLOCK_N=block_n,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), B_PAD=triton.next_power_of_2(num_seqs),
        NUM_SPLITS=num_splits, IS_FP32=is_fp32,
        # The interpreter's bf16 tl.dot is wrong (Triton 3.9); fp32 products of half values are
        # exact, so upcasting there computes what the tensor cores do (fp32 accumulation).
        UPCAST_DOT=not is_fp32 and is_interpreter(),
        num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            partial, lse, out, head_dim,
            partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits),
            D_PAD=triton.next_power_of_2(head_dim),
        )
    return out
