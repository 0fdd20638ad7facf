"""PyTorch implementations of the kernels API: the CPU execution path and the test oracle.

`paged_attention_reference` is what the engine runs on CPU (every layer, every step), so it is
vectorised: all decode sequences of a batch (one new token each) go through one gather and one
`scaled_dot_product_attention` call; sequences with several new tokens (prefill, chunked prefill)
are handled one at a time. `paged_attention_naive` is the obviously-correct version that tests
compare everything else with: per sequence, slot by slot, in float32.
"""

import math

import torch
import torch.nn.functional as F

from pagedserve_kernels._validate import check_paged_attention, check_write_kv


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V into the paged caches, in place (PyTorch version of `write_kv`).

    Args:
        key, value: (T, H_kv, D) K/V of the new tokens.
        k_cache, v_cache: (num_blocks, block_size, H_kv, D) the layer's caches.
        slot_mapping: (T,) slot of each token (`block_id * block_size + offset`); -1 skips it.
    """
    check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    is_written = slot_mapping >= 0  # (T,)
    slots = slot_mapping[is_written].long()  # (T',)
    # Index by (block, offset) rather than viewing the cache as (slots, H_kv, D), so that any
    # strides of the two leading dimensions work.
    block_ids, offsets = slots // block_size, slots % block_size
    k_cache[block_ids, offsets] = key[is_written]
    v_cache[block_ids, offsets] = value[is_written]


def _host_lengths(
    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_tokens: int, max_blocks: int, block_size: int
) -> tuple[list[int], list[int]]:
    """Read the lengths on the host and check them against each other; returns (seq_lens, q_lens)."""
    lens = seq_lens.tolist()
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must run from 0 to T={num_tokens}, got {cu[0]}..{cu[-1]}")
    q_lens = [hi - lo for lo, hi in zip(cu[:-1], cu[1:])]
    for b, (seq_len, q_len) in enumerate(zip(lens, q_lens)):
        if q_len < 0 or seq_len < q_len:
            raise ValueError(f"sequence {b}: {q_len} new tokens but seq_len {seq_len}")
        if -(-seq_len // block_size) > max_blocks:
            raise ValueError(f"sequence {b}: seq_len {seq_len} needs more than {max_blocks} blocks")
    return lens, q_lens


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_ctx_blocks: int) -> torch.Tensor:
    """Gather the first `num_ctx_blocks` blocks of each row of `block_tables`.

    Args:
        cache: (num_blocks, block_size, H_kv, D)
        block_tables: (N, max_blocks_per_seq)
    Returns:
        (N, H_kv, num_ctx_blocks * block_size, D), positions in order.
    """
    blocks = block_tables[:, :num_ctx_blocks].long()  # (N, nb)
    gathered = cache[blocks]  # (N, nb, bs, H_kv, D)
    return gathered.flatten(1, 2).transpose(1, 2)  # (N, H_kv, L, D)


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence, all sequences in one SDPA call.

    GQA without copying K/V per query head: the G query heads that share a KV head are laid out as
    G "query positions" of that head, so SDPA sees (N, H_kv, G, D) queries against (N, H_kv, L, D)
    keys.

    Args:
        query: (N, H_q, D) the new token of each sequence.
        block_tables: (N, max_blocks_per_seq); seq_lens: (N,) including the new token.
    Returns:
        (N, H_q, D)
    """
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_ctx_blocks = -(-max_seq_len // block_size)
    k = _gather_context(k_cache, block_tables, num_ctx_blocks)  # (N, H_kv, L, D)
    v = _gather_context(v_cache, block_tables, num_ctx_blocks)  # (N, H_kv, L, D)
    positions = torch.arange(k.shape[2], device=query.device)  # (L,)
    mask = positions[None, :] < seq_lens[:, None]  # (N, L)
    q = query.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # (N, H_kv, G, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_q_heads, head_dim)  # (N, H_q, D)


def _sequence_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one sequence's new tokens over its whole context, causal within the new tokens.

    Args:
        query: (q_len, H_q, D); block_table: (max_blocks_per_seq,)
    Returns:
        (q_len, H_q, D)
    """
    q_len = query.shape[0]
    block_size = k_cache.shape[1]
    table = block_table[None, :]  # (1, max_blocks)
    k = _gather_context(k_cache, table, -(-seq_len // block_size))[0, :, :seq_len]  # (H_kv, S, D)
    v = _gather_context(v_cache, table, -(-seq_len // block_size))[0, :, :seq_len]  # (H_kv, S, D)
    q = query.transpose(0, 1)  # (H_q, q_len, D)
    if q_len == seq_len:  # no cached context: plain causal attention
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_positions = torch.arange(seq_len - q_len, seq_len, device=query.device)  # (q_len,)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_positions[:, None]  # (q_len, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # (q_len, H_q, D)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Paged attention over a packed variable-length batch (PyTorch version of `paged_attention`).

    Args:
        query: (T, H_q, D) new tokens of B sequences, packed.
        k_cache, v_cache: (num_blocks, block_size, H_kv, D) with the new tokens already written.
        block_tables: (B, max_blocks_per_seq) physical block of each logical block.
        seq_lens: (B,) context length of each sequence including its new tokens.
        cu_seqlens_q: (B + 1,) new tokens of sequence b are query[cu[b]:cu[b+1]].
        scale: softmax scale, default 1/sqrt(D).
    Returns:
        (T, H_q, D) attention output, dtype of query.
    """
    check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    num_tokens, _, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lens, q_lens = _host_lengths(seq_lens, cu_seqlens_q, num_tokens, block_tables.shape[1], k_cache.shape[1])
    out = torch.empty_like(query)
    decode_ids = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if decode_ids:
        if len(decode_ids) == len(q_lens):  # pure decode: rows of query are the sequences, in order
            rows, tables, decode_lens = slice(None), block_tables, seq_lens
        else:
            ids = torch.tensor(decode_ids, device=query.device)
            rows, tables, decode_lens = cu_seqlens_q[ids].long(), block_tables[ids], seq_lens[ids]
        max_len = max(lens[b] for b in decode_ids)
        out[rows] = _decode_attention(query[rows], k_cache, v_cache, tables, decode_lens, max_len, scale)
    start = 0
    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(start, start + q_len)
            out[rows] = _sequence_attention(query[rows], k_cache, v_cache, block_tables[b], lens[b], scale)
        start += q_len
    return out


def paged_attention_naive(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Slow, obviously-correct paged attention in float32, the oracle of the tests.

    Same arguments and result as `paged_attention_reference`. Each position's slot is computed with
    the formula of the pool layout, `block_table[p // block_size] * block_size + p % block_size`.
    """
    check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lens, q_lens = _host_lengths(seq_lens, cu_seqlens_q, num_tokens, block_tables.shape[1], block_size)
    k_slots = k_cache.flatten(0, 1).float()  # (num_blocks * bs, H_kv, D)
    v_slots = v_cache.flatten(0, 1).float()
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(lens, q_lens)):
        table = block_tables[b].tolist()
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k = k_slots[slots].repeat_interleave(group, dim=1)  # (S, H_q, D)
        v = v_slots[slots].repeat_interleave(group, dim=1)  # (S, H_q, D)
        q = query[start:start + q_len].float()  # (q_len, H_q, D)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale  # (H_q, q_len, S)
        q_positions = torch.arange(seq_len - q_len, seq_len)  # (q_len,)
        visible = torch.arange(seq_len)[None, :] <= q_positions[:, None]  # (q_len, S)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqs,shd->qhd", scores.softmax(dim=-1), v)
        start += q_len
    return out.to(query.dtype)
