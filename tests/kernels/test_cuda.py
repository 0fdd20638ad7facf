"""Checks that need a GPU: the public API dispatching to compiled Triton kernels.

Run by scripts/gpu_checks_kernels.sh; skipped on CPU.
"""

import pytest
import torch

import pagedserve_kernels as kernels
from pagedserve_kernels.reference import paged_attention_naive, paged_attention_reference
from tests.kernels.helpers import dense_attention, make_paged_batch
from pagedserve_kernels.triton_attention import paged_attention_triton

pytestmark = pytest.mark.cuda
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(4, 128, 16), (3, 64, 32), (8, 128, 32), (1, 64, 16)])
def test_write_then_attend_through_public_api(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> None:
    """The engine's step: write the new tokens' K/V with write_kv, then paged_attention."""
    bs = block_size
    seq_lens, q_lens = [bs - 1, bs, bs + 1, 1, 3 * bs + 7, 200], [1, 1, 1, 1, bs + 3, 200]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=bs, dtype=dtype, device="cuda")
    k_cache, v_cache = torch.zeros_like(batch.k_cache), torch.zeros_like(batch.v_cache)
    table = batch.block_tables.long()
    for b, (key, value) in enumerate(zip(batch.keys, batch.values)):
        positions = torch.arange(key.shape[0], device="cuda")
        slots = table[b, positions // bs] * bs + positions % bs
        kernels.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)
    out = kernels.paged_attention(batch.query, k_cache, v_cache, *batch.args()[3:])
    _assert_close(out, dense_attention(batch), dtype)


@pytest.mark.parametrize("block_size", [16, 32])
def test_long_context_decode_uses_splits_and_matches(block_size: int) -> None:
    batch = make_paged_batch([8192, 5000], [1, 1], num_q_heads=32, num_kv_heads=8, head_dim=128,
                             block_size=block_size, dtype=torch.bfloat16, device="cuda")
    split = kernels.paged_attention(*batch.args())  # heuristic: 2 sequences x 8 heads -> split-KV
    unsplit = paged_attention_triton(*batch.args(), num_splits=1)
    torch.testing.assert_close(split.float(), unsplit.float(), atol=8e-3, rtol=0)
    _assert_close(split, paged_attention_naive(*batch.args()), torch.bfloat16)


def test_large_decode_batch_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, 700, (256,), generator=gen).tolist()
    batch = make_paged_batch(seq_lens, [1] * 256, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=torch.bfloat16, device="cuda")
    _assert_close(kernels.paged_attention(*batch.args()), paged_attention_reference(*batch.args()),
                  torch.bfloat16)


def test_capturable_in_a_cuda_graph() -> None:
    """Launchers read no tensor values on the host, so a decode step can be captured and replayed."""
    batch = make_paged_batch([300, 40, 41], [1, 1, 1], num_q_heads=8, num_kv_heads=2, head_dim=128,
                             block_size=16, dtype=torch.bfloat16, device="cuda")
    kernels.paged_attention(*batch.args())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_attention(*batch.args())
    batch.seq_lens.copy_(torch.tensor([299, 17, 41], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, paged_attention_naive(*batch.args()), torch.bfloat16)
