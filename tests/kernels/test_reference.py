"""The PyTorch reference (the CPU execution path) against the naive oracle and dense attention."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve_kernels import paged_attention, write_kv
from pagedserve_kernels.reference import paged_attention_naive, paged_attention_reference, write_kv_reference
from tests.kernels.helpers import dense_attention, make_paged_batch

REPO_ROOT = Path(__file__).resolve().parents[2]
# (atol, rtol) against a float32 oracle computed from the same rounded inputs.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_naive_and_dense(dtype: torch.dtype, group: int, block_size: int) -> None:
    bs = block_size
    # decode at block boundaries, a one-token sequence, chunked prefill on cached context, prefill
    seq_lens = [bs - 1, bs, bs + 1, 1, 2 * bs + 3, 40, bs]
    q_lens = [1, 1, 1, 1, bs + 2, 9, bs]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=64,
                             block_size=bs, dtype=dtype)
    expected = dense_attention(batch)
    _assert_close(paged_attention_naive(*batch.args()), expected, dtype)
    _assert_close(paged_attention_reference(*batch.args()), expected, dtype)


@pytest.mark.parametrize("block_size", [16, 32])
def test_pure_decode_batch_at_block_boundaries(block_size: int) -> None:
    seq_lens = [k * block_size + d for k in (1, 2, 3) for d in (-1, 0, 1)] + [1]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_q_heads=9, num_kv_heads=3, head_dim=64,
                             block_size=block_size)
    _assert_close(paged_attention_reference(*batch.args()), dense_attention(batch), torch.float32)


def test_reference_ignores_stale_slots() -> None:
    """Slots past a sequence's end (and padded table entries) hold stale data that must not count."""
    batch = make_paged_batch([17, 5, 40], [1, 5, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    expected = dense_attention(batch)
    for cache in (batch.k_cache, batch.v_cache):
        used = torch.zeros(cache.shape[:2], dtype=torch.bool)  # (num_blocks, block_size)
        for b, seq_len in enumerate(batch.seq_lens.tolist()):
            for p in range(seq_len):
                used[batch.block_tables[b, p // 16], p % 16] = True
        cache[~used] = 1e4
    _assert_close(paged_attention_reference(*batch.args()), expected, torch.float32)


def test_scale_argument() -> None:
    batch = make_paged_batch([20, 9], [1, 4], num_q_heads=4, num_kv_heads=4, head_dim=64, block_size=16)
    _assert_close(paged_attention_reference(*batch.args(), scale=0.3), dense_attention(batch, scale=0.3),
                  torch.float32)


def test_public_api_on_cpu_is_the_reference() -> None:
    batch = make_paged_batch([33, 12], [1, 12], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    assert torch.equal(paged_attention(*batch.args()), paged_attention_reference(*batch.args()))


def test_write_kv_scatters_and_skips_padding() -> None:
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    write_kv(key, value, k_cache, v_cache, torch.tensor([33, -1, 0, 63], dtype=torch.int32))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], value[0])
    assert torch.equal(k_cache[0, 0], key[2]) and torch.equal(k_cache[3, 15], key[3])
    assert torch.count_nonzero(k_cache.flatten(0, 1).abs().sum((1, 2))) == 3  # the -1 token wrote nothing


def test_write_kv_into_pool_views() -> None:
    pool = torch.zeros(3, 2, 5, 16, 2, 8)  # (layers, K/V, blocks, block_size, H_kv, D)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    write_kv_reference(key, value, pool[1, 0], pool[1, 1], torch.tensor([17, 79]))
    assert torch.equal(pool[1, 0, 1, 1], key[0]) and torch.equal(pool[1, 1, 4, 15], value[1])
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


@pytest.mark.parametrize(
    ("seq_lens", "cu_seqlens_q", "message"),
    [([3], [0, 4], "seq_len"), ([5], [0, 2], "run from 0"), ([40], [0, 1], "blocks")],
)
def test_reference_rejects_inconsistent_lengths(seq_lens: list[int], cu_seqlens_q: list[int], message: str) -> None:
    num_tokens = cu_seqlens_q[-1] if message != "run from 0" else 3
    query = torch.randn(num_tokens, 2, 16)
    cache = torch.zeros(4, 16, 2, 16)
    block_tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        paged_attention_reference(query, cache, cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                                  torch.tensor(cu_seqlens_q, dtype=torch.int32))


def _run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, check=True)
    return result.stdout.strip()


def test_import_is_light() -> None:
    """Triton (about a second, and absent from the CPU image) loads on the first CUDA call only."""
    out = _run_python("import sys, pagedserve_kernels; print('triton' in sys.modules)")
    assert out == "False"
