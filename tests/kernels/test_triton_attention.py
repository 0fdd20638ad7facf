"""Triton paged attention (interpreter on CPU, compiled on CUDA) against the oracles."""

import pytest
import torch

from pagedserve_kernels.reference import paged_attention_naive
from tests.kernels.helpers import PagedBatch, dense_attention, make_paged_batch
from pagedserve_kernels.triton_attention import choose_num_splits, paged_attention_triton

# (atol, rtol) against a float32 oracle computed from the same rounded inputs: half-precision
# outputs are rounded once, and the probabilities are rounded to the input dtype before P @ V.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def _mixed_lengths(block_size: int) -> tuple[list[int], list[int]]:
    """Decode at k*B-1, k*B, k*B+1 and of a one-token sequence, chunked prefill, plain prefill."""
    bs = block_size
    return [bs - 1, bs, bs + 1, 1, 2 * bs + 3, 2 * bs, bs + 5], [1, 1, 1, 1, bs + 2, bs, bs + 5]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GROUPS = [1, 3, 4, 8]
SHAPES = [(64, 16), (128, 32), (64, 32), (128, 16)]  # (head_dim, block_size)
if torch.cuda.is_available():  # compiled kernels are fast: the full product
    CONFIGS = [(d, g, hd, bs) for d in DTYPES for g in GROUPS for hd, bs in SHAPES]
else:  # interpreter: every (dtype, group) pair; each dtype meets every shape, each group three of them
    CONFIGS = [(d, g, *SHAPES[(i + j) % 4]) for j, d in enumerate(DTYPES) for i, g in enumerate(GROUPS)]


@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size"), CONFIGS)
def test_mixed_batch_every_config(triton_device: str, dtype: torch.dtype, group: int, head_dim: int,
                                  block_size: int) -> None:
    seq_lens, q_lens = _mixed_lengths(block_size)
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=triton_device)
    out = paged_attention_triton(*batch.args())
    assert out.dtype == dtype and out.shape == batch.query.shape
    _assert_close(out, dense_attention(batch), dtype)
    _assert_close(out, paged_attention_naive(*batch.to("cpu").args()), dtype)


@pytest.mark.parametrize("block_size", [16, 32])
def test_masks_at_block_boundaries(triton_device: str, block_size: int) -> None:
    """Every slot outside the visible context is NaN: any leak through a mask poisons the output."""
    bs = block_size
    seq_lens = [k * bs + d for k in (1, 2) for d in (-1, 0, 1)] + [1, 2 * bs, 2 * bs + 1, 3 * bs - 1]
    q_lens = [1] * 7 + [bs, bs + 1, bs - 1]  # prefill chunks ending exactly at / around boundaries
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=bs)
    expected = dense_attention(batch)
    used = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool)  # (num_blocks, block_size)
    for b, seq_len in enumerate(seq_lens):
        for p in range(seq_len):
            used[batch.block_tables[b, p // bs], p % bs] = True
    batch.k_cache[~used] = float("nan")
    batch.v_cache[~used] = float("nan")
    for num_splits in (1, 3):
        out = paged_attention_triton(*batch.to(triton_device).args(), num_splits=num_splits)
        assert torch.isfinite(out).all()
        _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulation(triton_device: str, dtype: torch.dtype) -> None:
    """4096 equal scores over V ~ 40: sum(p) = 4096 and sum(p * v) ~ 1.6e5 are beyond what fp16
    accumulators hold (2049 is not representable, 65504 is the largest value); fp32 must be used."""
    seq_len = 4096
    batch = make_paged_batch([seq_len], [1], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=32,
                             dtype=dtype)
    batch.query.zero_()  # every score is 0: uniform attention, output = mean of V
    batch.v_cache.mul_(0.5).add_(40.0)
    v_mean = torch.cat([batch.v_cache[b] for b in batch.block_tables[0].tolist()]).float().mean(0)  # (H_kv, D)
    assert torch.isinf(batch.v_cache.flatten(0, 1)[:, 0, 0].half().sum(dtype=torch.float16))  # naive fp16 overflows
    for num_splits in (1, 4):
        out = paged_attention_triton(*batch.to(triton_device).args(), num_splits=num_splits)
        torch.testing.assert_close(out.float().cpu(), v_mean.expand(1, 2, 64), atol=0.0, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_logits_are_stable(triton_device: str, dtype: torch.dtype) -> None:
    """Scores in the thousands overflow exp() without the running-max shift."""
    batch = make_paged_batch([300, 70], [1, 20], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=dtype)
    batch.query.mul_(16)
    batch.k_cache.mul_(16)
    batch.keys = [k * 16 for k in batch.keys]
    out = paged_attention_triton(*batch.to(triton_device).args())
    assert torch.isfinite(out).all()
    _assert_close(out, dense_attention(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 3, 7, 40])
def test_split_kv_equals_unsplit(triton_device: str, dtype: torch.dtype, num_splits: int) -> None:
    # 40 splits of the 320-token bound leave most splits empty for every sequence.
    batch = make_paged_batch([300, 17, 64, 90], [1, 1, 1, 12], num_q_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=16, dtype=dtype, device=triton_device)
    unsplit = paged_attention_triton(*batch.args(), num_splits=1)
    split = paged_attention_triton(*batch.args(), num_splits=num_splits)
    atol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: only the final rounding differs
    torch.testing.assert_close(split.float(), unsplit.float(), atol=atol, rtol=0)
    _assert_close(split, dense_attention(batch), dtype)


@pytest.mark.parametrize(("block_q", "block_n"), [(4, 16), (16, 32), (8, 128), (64, 64)])
def test_tile_sizes_agree(triton_device: str, block_q: int, block_n: int) -> None:
    batch = make_paged_batch([70, 33, 16], [1, 20, 16], num_q_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16, device=triton_device)
    out = paged_attention_triton(*batch.args(), block_q=block_q, block_n=block_n)
    _assert_close(out, dense_attention(batch), torch.float32)


def test_strided_query_pool_views_and_int64_indices(triton_device: str) -> None:
    """query as a slice of a fused QKV projection; caches as views of one multi-layer pool."""
    batch = make_paged_batch([45, 20], [1, 6], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    pool = torch.zeros(2, 2, *batch.k_cache.shape)  # (layers, K/V, blocks, bs, H_kv, D)
    pool[1, 0], pool[1, 1] = batch.k_cache, batch.v_cache
    qkv = torch.zeros(batch.query.shape[0], 10, 64)  # (T, H_q + 2 H_kv, D)
    qkv[:, :6] = batch.query
    pool, qkv = pool.to(triton_device), qkv.to(triton_device)
    out = paged_attention_triton(qkv[:, :6], pool[1, 0], pool[1, 1], batch.block_tables.long().to(triton_device),
                                 batch.seq_lens.long().to(triton_device), batch.cu_seqlens_q.to(triton_device))
    _assert_close(out, dense_attention(batch), torch.float32)


def test_empty_batch(triton_device: str) -> None:
    batch = make_paged_batch([5], [0], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                             device=triton_device)
    assert paged_attention_triton(*batch.args()).shape == (0, 2, 64)


def test_split_heuristic() -> None:
    assert choose_num_splits(num_tiles=256, num_kv_heads=8, max_context=8192, num_units=132) == 1
    assert choose_num_splits(num_tiles=2, num_kv_heads=8, max_context=8192, num_units=132) == 17
    assert choose_num_splits(num_tiles=1, num_kv_heads=8, max_context=512, num_units=132) == 2
    assert choose_num_splits(num_tiles=1, num_kv_heads=1, max_context=100_000, num_units=132) == 32
    assert choose_num_splits(num_tiles=1, num_kv_heads=8, max_context=200, num_units=132) == 1


def _bad_inputs(batch: PagedBatch) -> dict[str, tuple[tuple[torch.Tensor, ...], str]]:
    q, kc, vc, bt, sl, cu = batch.args()
    return {
        "query rank": ((q[0], kc, vc, bt, sl, cu), "query must be"),
        "head dim": ((q[..., :32], kc, vc, bt, sl, cu), "query must be"),
        "heads not a multiple": ((q[:, :3], kc, vc, bt, sl, cu), "multiple"),
        "dtype mismatch": ((q.half(), kc, vc, bt, sl, cu), "dtype"),
        "unsupported dtype": ((q.double(), kc.double(), vc.double(), bt, sl, cu), "dtype"),
        "float block table": ((q, kc, vc, bt.float(), sl, cu), "block_tables"),
        "cu_seqlens length": ((q, kc, vc, bt, sl, cu[:-1]), "cu_seqlens_q"),
        "block table rows": ((q, kc, vc, bt.repeat(2, 1), sl, cu), "block_tables"),
        "v cache shape": ((q, kc, vc[:, :8], bt, sl, cu), "v_cache"),
        "strided head dim": ((q, kc, vc[..., ::2].repeat_interleave(2, -1).transpose(-1, -2).contiguous()
                              .transpose(-1, -2), bt, sl, cu), "contiguous"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs(make_paged_batch([20], [2], num_q_heads=4, num_kv_heads=2,
                                                                   head_dim=64, block_size=16))))
def test_launcher_rejects_bad_arguments(case: str) -> None:
    batch = make_paged_batch([20], [2], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    args, message = _bad_inputs(batch)[case]
    with pytest.raises(ValueError, match=message):
        paged_attention_triton(*args)


def test_launcher_rejects_bad_tiles() -> None:
    batch = make_paged_batch([20], [2], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(*batch.args(), block_n=48)
    with pytest.raises(ValueError, match="16 rows"):
        paged_attention_triton(*batch.args(), block_q=2)
