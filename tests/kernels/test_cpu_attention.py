"""The fused CPU kernels (kernels/pagedserve_kernels/csrc/cpu_ops.cpp) against the naive oracle and PyTorch ops.

Paged attention is checked on shuffled block tables (blocks handed out in random order), lengths at
block boundaries, GQA groups of 1 to 64, prompt chunks longer than one query tile over cached
context, fresh prompts, decodes long enough to be split across threads, every head size and block
sizes the AVX-512 kernels take (4, 8, 16) or leave to the portable one (6, 32). Both kernels run
here: `paged_attention` (AVX-512 where the build has it) and `paged_attention_portable`.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import cpu_ops
from pagedserve_kernels.cpu_attention import CpuAttentionPlan
from pagedserve_kernels.reference import paged_attention_naive, paged_attention_reference
from tests.kernels.helpers import make_paged_batch

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the fused CPU kernels could not be built here")


KERNELS = ("paged_attention", "paged_attention_portable")


def run_op(batch, seq_ids: list[int], scale: float, kernel: str = "paged_attention") -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    getattr(ops, kernel)(out, batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                        batch.cu_seqlens_q, torch.tensor(seq_ids, dtype=torch.int64), scale)
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_and_chunks_match_the_oracle(num_q_heads: int, num_kv_heads: int, head_dim: int, kernel: str) -> None:
    block_size = 4
    # Boundary lengths (1, bs - 1, bs, bs + 1, 2 bs), a 1-token prompt, chunks of 1, 5 and 37 new
    # tokens over cached context (37 > one 16-row query tile), and a fresh prompt of 6 tokens.
    seq_lens = [1, 3, 4, 5, 8, 9, 40, 50, 6]
    q_lens = [1, 1, 1, 1, 1, 5, 37, 1, 6]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, block_size=block_size, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    want = paged_attention_naive(*batch.args(), scale=scale)
    got = run_op(batch, list(range(len(seq_lens))), scale, kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size", [4, 8, 16, 6, 32])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_every_head_size_and_block_size(head_dim: int, block_size: int, kernel: str) -> None:
    # Decodes at block boundaries and one over 41 blocks (split in slices, merged afterwards), a
    # fresh prompt over two 16-position query tiles, chunks over cached context that cross blocks
    # and tiles, a 1-token chunk.
    # Speculative verification: 2-4 positions whose causal edge falls inside a block or on its start.
    seq_lens = [1, block_size, block_size + 1, 40 * block_size + 3, 30, 70, 23, 9, 3 * block_size + 2,
                2 * block_size + 3, 50]
    q_lens = [1, 1, 1, 1, 30, 21, 7, 1, 4, 3, 2]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=9, num_kv_heads=3, head_dim=head_dim,
                             block_size=block_size, generator=torch.Generator().manual_seed(head_dim + block_size))
    scale = head_dim**-0.5
    want = paged_attention_naive(*batch.args(), scale=scale)
    got = run_op(batch, list(range(len(seq_lens))), scale, kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 1), (20, 1), (64, 1), (12, 3)])
def test_large_groups_and_long_fresh_prompts(num_q_heads: int, num_kv_heads: int, kernel: str) -> None:
    """Groups wider than a 48-row tile (64 heads) are split by heads; a 2-head group puts 24
    positions in a tile; a fresh prompt of 100 tokens spans tiles and diagonal blocks."""
    seq_lens, q_lens = [100, 37, 260, 5], [100, 17, 1, 5]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=16,
                             block_size=16, generator=torch.Generator().manual_seed(num_q_heads))
    want = paged_attention_naive(*batch.args(), scale=0.25)
    got = run_op(batch, list(range(len(seq_lens))), 0.25, kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_large_scores_keep_the_softmax_stable() -> None:
    """Scores of hundreds (a max that jumps between blocks) must not overflow exp."""
    batch = make_paged_batch([300, 40], [1, 40], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                             generator=torch.Generator().manual_seed(5))
    batch.k_cache.mul_(torch.linspace(1, 30, batch.k_cache.shape[0]).view(-1, 1, 1, 1))  # growing per block
    want = paged_attention_naive(*batch.args(), scale=1.0)
    for kernel in KERNELS:
        torch.testing.assert_close(run_op(batch, [0, 1], 1.0, kernel), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_only_the_given_sequences_are_written(kernel: str) -> None:
    batch = make_paged_batch([10, 7, 12], [1, 7, 2], num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4)
    got = run_op(batch, [0, 2], 0.2, kernel)
    want = paged_attention_naive(*batch.args(), scale=0.2)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[8:], want[8:])
    assert got[1:8].isnan().all()  # sequence 1 was not asked for


@pytest.mark.parametrize("block_size", [4, 6])  # fresh prompt through the op (AVX-512) / through SDPA
def test_plan_splits_fresh_prompts_and_matches_the_reference(block_size: int) -> None:
    """The whole fused path: write K/V, then attend (fresh prompts through the op where it runs
    the AVX-512 kernels, through SDPA beside the portable one)."""
    gen = torch.Generator().manual_seed(2)
    num_q_heads, num_kv_heads, head_dim = 6, 2, 16
    seq_lens, q_lens = [9, 1, 13, 22], [9, 1, 4, 1]  # fresh prompt, 1-token prompt, chunk, decode
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, block_size=block_size, generator=gen)
    # The new tokens' K/V, as the model would produce them: taken from the cache, then wiped there
    # so that the plan must write them back.
    tables, cu = batch.block_tables.tolist(), batch.cu_seqlens_q.tolist()
    slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size
                          for b, (s, q) in enumerate(zip(seq_lens, q_lens)) for p in range(s - q, s)])
    flat_k = batch.k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = batch.v_cache.view(-1, num_kv_heads, head_dim)
    key, value = flat_k[slots].clone(), flat_v[slots].clone()
    want = paged_attention_reference(*batch.args(), scale=0.3)
    flat_k[slots] = 0.0
    flat_v[slots] = 0.0
    plan = CpuAttentionPlan.build(slots, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
                                  dtype=torch.float32, head_dim=head_dim)
    assert plan is not None and plan.seq_ids.tolist() == [0, 1, 2, 3]
    assert plan.fresh == [(0, 9)] and plan.other_seq_ids.tolist() == [1, 2, 3]
    got = plan.write_and_attend(batch.query, key, value, batch.k_cache, batch.v_cache, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat_k[slots], key)
    torch.testing.assert_close(flat_v[slots], value)
    assert cu[-1] == got.shape[0]


def test_the_avx512_kernels_take_block_sizes_up_to_16_in_steps_of_4() -> None:
    level = cpu_ops.level() or ""  # x86-64-v4 has AVX-512 F, a native build has it where the CPU does
    avx512 = level.startswith("x86-64-v4") or (level == "native" and "avx512f" in cpu_ops._cpu_flags().split())
    assert [ops.avx512_attention(bs) for bs in (4, 8, 12, 16)] == [avx512] * 4
    assert not any(ops.avx512_attention(bs) for bs in (1, 6, 32))


def test_plan_is_none_where_the_fused_path_does_not_apply() -> None:
    args = (torch.zeros(2, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    assert CpuAttentionPlan.build(*args, dtype=torch.float16, head_dim=64) is None
    assert CpuAttentionPlan.build(*args, dtype=torch.bfloat16, head_dim=64) is not None
    assert CpuAttentionPlan.build(*args, dtype=torch.float32, head_dim=80) is None
    assert CpuAttentionPlan.build(*args, dtype=torch.float32, head_dim=64) is not None


@pytest.mark.parametrize("rows", [5, 1500])  # decode-sized (one thread) and split across threads
def test_fused_elementwise_ops_match_pytorch(rows: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 96, generator=gen)
    weight = 1.0 + 0.1 * torch.randn(96, generator=gen)
    eps = 1e-5
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    torch.testing.assert_close(ops.rms_norm(x, weight, eps), rms)

    residual, delta = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    total = residual + delta
    normed = ops.add_rms_norm(residual, delta, weight, eps)
    torch.testing.assert_close(residual, total)  # updated in place
    torch.testing.assert_close(normed, total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight)

    gate_up = 4 * torch.randn(rows, 2 * 50, generator=gen)  # 3 vectors of 16 and a tail of 2
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)

    num_tokens, num_heads, head_dim = rows, 3, 16
    qkv = torch.randn(num_tokens, (num_heads + 1) * head_dim, generator=gen)  # last head is not rotated ("v")
    angles = torch.randn(num_tokens, head_dim // 2, generator=gen).repeat(1, 2)  # (T, D) as [f | f]
    cos, sin = angles.cos(), angles.sin()
    heads = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    x1, x2 = heads.chunk(2, dim=-1)
    want = heads * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    untouched = qkv[:, num_heads * head_dim:].clone()
    ops.rotary_(qkv, cos, sin, num_heads, head_dim)
    torch.testing.assert_close(qkv[:, : num_heads * head_dim].view_as(want), want)
    assert torch.equal(qkv[:, num_heads * head_dim:], untouched)


@pytest.mark.parametrize("rows", [5, 1500])
def test_write_kv_copies_strided_rows_to_their_slots_and_skips_negative_ones(rows: int) -> None:
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, num_kv_heads, head_dim = 200, 8, 3, 16
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(rows, (9 + 2 * num_kv_heads) * head_dim, generator=gen)  # fused rows [q | k | v]
    k, v = qkv[:, 9 * head_dim :].split(num_kv_heads * head_dim, dim=-1)
    key, value = k.view(rows, num_kv_heads, head_dim), v.view(rows, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[rows // 2] = -1  # not written
    ops.write_kv_(k_cache, v_cache, key, value, slots)
    written = slots >= 0
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots[written]], key[written]) and torch.equal(flat_v[slots[written]], value[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    with pytest.raises(RuntimeError, match="past the cache"):
        ops.write_kv_(k_cache, v_cache, key, value, torch.full((rows,), num_blocks * block_size))


def test_ops_run_on_torchs_threads() -> None:
    """Built without OpenMP, at::parallel_for silently runs every op on one thread."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ops.parallel_threads() == 2
        torch.set_num_threads(1)
        assert ops.parallel_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_unbuildable_extension_falls_back_with_an_error(tmp_path, monkeypatch, caplog) -> None:
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "cpu_ops.cpp").write_text("#error this source does not compile\n")
    monkeypatch.setattr(cpu_ops, "_CSRC", tmp_path / "csrc")
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="pagedserve_kernels.cpu_ops"):
        assert cpu_ops.load() is None
    assert any(r.levelno == logging.ERROR and "slower PyTorch path (torch-fallback)" in r.getMessage()
               for r in caplog.records), caplog.text
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    assert cpu_ops.load() is None
