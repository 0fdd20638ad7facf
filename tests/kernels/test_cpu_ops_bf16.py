"""The fused CPU kernels on bfloat16 tensors against float32 references (the bf16 contract).

Each op reads bf16, computes in float32 and rounds once on store, so its output differs from the
float32 reference run on the same (bf16-rounded) inputs by the output's own rounding: at most half
a bf16 unit in the last place, 2^-9 relative (0.2%). The tolerance below, rtol 2^-8 with a small
atol for values near zero, allows twice that; a kernel that rounded its accumulators to bf16 (or
read K/V wrongly) would miss it by far. No output may be NaN or inf.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedserve_kernels as kernels
from pagedserve_kernels import cpu_linear, cpu_ops
from pagedserve_kernels.reference import paged_attention_naive
from tests.kernels.helpers import make_paged_batch

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the fused CPU kernels could not be built here")

BF16_RTOL = 2**-8  # twice one bf16 rounding of the output
BF16_ATOL = 1e-3


def close_to_float32(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), want, rtol=BF16_RTOL, atol=BF16_ATOL)


def attend(batch, k_cache: torch.Tensor, scale: float, kernel: str = "paged_attention",
           seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the op's output, the float32 oracle's) for the batch's bf16 queries over k_cache and its V; rows of
    sequences not in seq_ids (default: all) stay NaN."""
    query = batch.query.bfloat16()
    want = paged_attention_naive(query.float(), k_cache.float(), batch.v_cache.float(), *batch.args()[3:], scale=scale)
    out = torch.full_like(query, float("nan"))
    seq_ids = torch.arange(len(batch.seq_lens)) if seq_ids is None else seq_ids
    getattr(ops, kernel)(out, query, k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                         batch.cu_seqlens_q, seq_ids, scale)
    return out, want


@pytest.mark.parametrize("kernel", ["paged_attention", "paged_attention_portable"])
@pytest.mark.parametrize("block_size", [16, 4, 6])  # AVX-512 kernels (16, 4); the portable one (6)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])  # 32, 64, 128: bf16 pairs (vdpbf16ps) where the build has them
def test_paged_attention_bf16_matches_float32(kernel: str, block_size: int, head_dim: int) -> None:
    # decodes (one long enough to be split across threads), a chunk over cached context, a fresh
    # prompt over two query tiles, a 3-token speculative-style chunk.
    seq_lens, q_lens = [1, 17, 700, 60, 40, 33], [1, 1, 1, 21, 40, 3]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=9, num_kv_heads=3, head_dim=head_dim,
                             block_size=block_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    close_to_float32(*attend(batch, batch.k_cache, head_dim**-0.5, kernel))


def fill_unowned_slots_with_nan(batch, seq_lens: list[int], block_size: int) -> None:
    """Every pool slot no sequence owns holds NaN (a pool's free rows hold whatever they last held)."""
    used = torch.zeros(batch.k_cache.shape[0] * block_size, dtype=torch.bool)
    for b, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        used[batch.block_tables[b, positions // block_size].long() * block_size + positions % block_size] = True
    for cache in (batch.k_cache, batch.v_cache):
        cache.view(-1, *cache.shape[2:])[~used] = float("nan")


@pytest.mark.parametrize("kernel", ["paged_attention", "paged_attention_portable"])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_paged_attention_bf16_never_reads_slots_past_a_sequence(kernel: str, block_size: int, head_dim: int) -> None:
    # Every slot no sequence owns holds NaN (a pool's free rows hold whatever they last held): odd
    # lengths leave the last block's rows past the end, which the bf16 pair kernel pairs with zeros.
    seq_lens, q_lens = [1, 17, 99, 35, 7], [1, 1, 1, 3, 7]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=6, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(8))
    fill_unowned_slots_with_nan(batch, seq_lens, block_size)
    close_to_float32(*attend(batch, batch.k_cache, head_dim**-0.5, kernel))


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_long_prompts_on_amx_tiles_match_float32(block_size: int, head_dim: int) -> None:
    # Prompts of 64 new tokens or more take the AMX tiles where the CPU has them (csrc/prefill_tiles.h;
    # elsewhere the AVX-512 tiles, the same contract): fresh ones, a chunk over cached context that
    # ends mid-block, one at exactly the threshold, beside a decode and a short prompt in one step;
    # slots no sequence owns hold NaN (the gather must not read them, nor the padding past a prompt).
    # The last three span several of the online softmax's 256-token steps: fresh, a chunk over 570
    # cached tokens that ends mid-step, and one over 470 whose items reach into a step some of their
    # rows cannot see at all.
    if cpu_linear.amx() and ops.attention_isa() == "avx512-bf16":  # the tiles are what this test runs here
        assert ops.prompt_tiles_min_tokens() == 64
    seq_lens, q_lens = [150, 1, 200, 64, 40, 97, 600, 700, 700], [150, 1, 121, 64, 40, 97, 600, 130, 230]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(11))
    fill_unowned_slots_with_nan(batch, seq_lens, block_size)
    close_to_float32(*attend(batch, batch.k_cache, head_dim**-0.5))
    # A step's subset of the batch, out of order: only the listed sequences' rows are written.
    subset = torch.tensor([5, 2, 0, 3])
    out, want = attend(batch, batch.k_cache, head_dim**-0.5, seq_ids=subset)
    cu = batch.cu_seqlens_q.tolist()
    for b in range(len(seq_lens)):
        rows = slice(cu[b], cu[b + 1])
        if b in subset.tolist():
            close_to_float32(out[rows], want[rows])
        else:
            assert bool(torch.isnan(out[rows].float()).all())


@pytest.mark.parametrize("num_q_heads,num_kv_heads",
                         [(8, 2), (10, 2), (12, 2), (16, 2), (12, 1), (16, 1), (9, 3), (7, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_grouped_decodes_on_amx_tiles_match_float32(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    # Single-position decodes of KV heads with 3 or more query heads take the AMX tiles where the
    # build has them (csrc/decode_tiles.h): groups of up to 8 the per-head kernel, of 9-16 the
    # vertical one (12 and 16 here); groups of 1 and 2 keep the AVX-512 kernel.
    # Lengths inside, at and just past a block, a decode long enough to be split across threads (its
    # partials merged), beside a 3-position chunk and a prompt in the same step; slots no sequence
    # owns hold NaN (the last block's rows past a sequence must not reach the products).
    group = num_q_heads // num_kv_heads
    if cpu_linear.amx() and cpu_ops.level() in ("native", "x86-64-v4-avx512bf16-amx"):  # built with AMX here
        assert ops.decode_tiles_min_group() == 3  # the tiles are what this test runs here (groups of 3+)
        paths = [kernels.kernel_paths(torch.device("cpu"), torch.bfloat16, head_dim, group=g)["attention"]
                 for g in (2, 3, 16, 17)]
        assert [", decode amx-tiles" in path for path in paths] == [False, True, True, False]
    seq_lens, q_lens = [1, 15, 16, 17, 1000, 333, 40, 90], [1, 1, 1, 1, 1, 1, 3, 90]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, block_size=16, dtype=torch.bfloat16,
                             generator=torch.Generator().manual_seed(group * head_dim))
    fill_unowned_slots_with_nan(batch, seq_lens, 16)
    close_to_float32(*attend(batch, batch.k_cache, head_dim**-0.5))
    # Large scores: keys grow with the physical block id, and the tables are shuffled, so the running
    # max moves up and down the blocks a sequence reads (its output so far rescaled each time it rises).
    rising = batch.k_cache.float() * torch.linspace(1, 8, batch.k_cache.shape[0])[:, None, None, None]
    close_to_float32(*attend(batch, rising.bfloat16(), head_dim**-0.5))


def test_ops_refuse_mixed_dtypes() -> None:
    batch = make_paged_batch([5], [1], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                             dtype=torch.bfloat16)
    out = torch.empty(1, 2, 16)
    with pytest.raises(RuntimeError, match="dtype"):  # a float32 query over a bf16 pool
        ops.paged_attention(out, out.clone(), batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                            batch.cu_seqlens_q, torch.arange(1), 0.25)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(torch.randn(2, 16).bfloat16(), torch.ones(16), 1e-5)


@pytest.mark.parametrize("rows", [5, 1500])  # decode-sized (one thread) and split across threads
def test_elementwise_ops_bf16_match_float32(rows: int) -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    weight = (1.0 + 0.1 * torch.randn(96, generator=gen)).bfloat16()
    eps = 1e-5
    x32, w32 = x.float(), weight.float()
    close_to_float32(ops.rms_norm(x, weight, eps), x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w32)

    residual, delta = torch.randn(rows, 96, generator=gen).bfloat16(), torch.randn(rows, 96, generator=gen).bfloat16()
    total = residual.float() + delta.float()
    normed = ops.add_rms_norm(residual, delta, weight, eps)
    close_to_float32(residual, total)  # updated in place, rounded once
    want = residual.float() * torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + eps) * w32
    close_to_float32(normed, want)

    gate_up = (4 * torch.randn(rows, 2 * 50, generator=gen)).bfloat16()  # 3 vectors of 16 and a tail of 2
    gate, up = gate_up.float().chunk(2, dim=-1)
    close_to_float32(ops.silu_mul(gate_up), F.silu(gate) * up)

    num_tokens, num_heads, head_dim = rows, 3, 16
    qkv = torch.randn(num_tokens, (num_heads + 1) * head_dim, generator=gen).bfloat16()  # last head: not rotated
    angles = torch.randn(num_tokens, head_dim // 2, generator=gen).repeat(1, 2)  # (T, D) float32 as [f | f]
    cos, sin = angles.cos(), angles.sin()
    heads = qkv[:, : num_heads * head_dim].float().view(num_tokens, num_heads, head_dim)
    x1, x2 = heads.chunk(2, dim=-1)
    want = heads * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    untouched = qkv[:, num_heads * head_dim:].clone()
    ops.rotary_(qkv, cos, sin, num_heads, head_dim)
    close_to_float32(qkv[:, : num_heads * head_dim].view_as(want), want)
    assert torch.equal(qkv[:, num_heads * head_dim:], untouched)


def test_write_kv_bf16_copies_rows_exactly() -> None:
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, num_kv_heads, head_dim, rows = 20, 4, 2, 16, 30
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(rows, 2 * num_kv_heads * head_dim, generator=gen).bfloat16()  # strided rows [k | v]
    key, value = (t.view(rows, num_kv_heads, head_dim) for t in kv.split(num_kv_heads * head_dim, dim=-1))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    ops.write_kv_(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], key)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[slots], value)


def linear_case(num_rows: int, in_features: int, out_features: int) -> tuple[torch.Tensor, ...]:
    """x (num_rows, in), a weight (out, in) scaled to unit outputs and a bias (out,), bf16, seeded by num_rows."""
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=generator).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    return x, weight, bias


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 9, 16])  # passes of 4 rows of x and their remainders
@pytest.mark.parametrize("shape", [(576, 960), (64, 300), (33, 70)])  # (K, N): K % 64, % 32 and odd tails
def test_small_linear_matches_float32(num_rows: int, shape: tuple[int, int]) -> None:
    # The decode linear (csrc/small_linear_bf16.h) against the float32 product of the same bf16 values:
    # one rounding of each output, with and without a bias; a row's result does not depend on the
    # other rows (so a sequence's logits do not depend on what else runs in its step).
    if ops.small_linear_rows() == 0:
        pytest.skip("this build has no AVX512-BF16 small-batch linear")
    in_features, out_features = shape
    x, weight, bias = linear_case(num_rows, in_features, out_features)
    for b in (None, bias):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        got = ops.small_linear(x, weight, b)
        close_to_float32(got, want)
        assert torch.equal(ops.small_linear(x[-1:].contiguous(), weight, b), got[-1:])


@pytest.mark.parametrize("num_rows", [1, 5, 16])  # decode rows
def test_small_linear_float_is_the_same_product_unrounded(num_rows: int) -> None:
    # The LM head's float32 logits (and decode's qkv, o and down outputs): the very sums small_linear
    # rounds to bf16, so rounding them gives its outputs bit for bit, and they are float32-close to
    # the float32 product of the same bf16 values (a rounding of bf16 would be 2**-9 off).
    if ops.small_linear_rows() == 0:
        pytest.skip("this build has no AVX512-BF16 small-batch linear")
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 576, generator=generator).bfloat16()
    weight = (torch.randn(1000, 576, generator=generator) / 24).bfloat16()
    bias = torch.randn(1000, generator=generator).bfloat16()
    for b in (None, bias):
        got = ops.small_linear_float(x, weight, b)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x.float(), weight.float(), None if b is None else b.float()),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(got.bfloat16(), ops.small_linear(x, weight, b))


@pytest.mark.parametrize("num_rows", [1, 2, 5, 16, 33])  # decode rows, and past one brgemm call's 32
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (70, 128)])  # (K, N): the default model's, an even tail
def test_small_linear_on_amx_tiles_has_the_plain_kernels_contract(num_rows: int, shape: tuple[int, int]) -> None:
    # On an AMX CPU the small-batch rows read the weight packed for the tiles (csrc/brgemm_linear.h):
    # the same contract as the dot-product kernel: float32-close to the float32 product of the same
    # bf16 values, bf16 outputs the float32 ones rounded once, a row's result independent of the others.
    if not ops.brgemm_linear_available():
        pytest.skip("no bf16 brgemm (AMX) on this CPU")
    in_features, out_features = shape
    x, weight, bias = linear_case(num_rows, in_features, out_features)
    tiles = ops.brgemm_pack(weight)
    assert tiles.shape == (out_features // 64, in_features // 2, 64, 2) and tiles.nbytes == weight.nbytes
    for b in (None, bias):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        got = ops.small_linear_float(x, tiles, b)
        assert got.dtype == torch.float32 and got.shape == (num_rows, out_features)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(ops.small_linear(x, tiles, b), got.bfloat16())
        assert torch.equal(ops.small_linear_float(x[-1:].contiguous(), tiles, b), got[-1:])


def test_brgemm_pack_refuses_what_the_tiles_cannot_take() -> None:
    if not ops.brgemm_linear_available():
        pytest.skip("no bf16 brgemm (AMX) on this CPU")
    for shape in ((100, 64), (128, 63)):  # outputs not a multiple of 64; an odd K
        with pytest.raises(RuntimeError, match="multiple of 64"):
            ops.brgemm_pack(torch.zeros(shape, dtype=torch.bfloat16))
    tiles = ops.brgemm_pack(torch.zeros(128, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="small_linear"):  # x's K against a weight packed for another
        ops.small_linear(torch.zeros(2, 32, dtype=torch.bfloat16), tiles, None)


def test_a_float32_residual_stream_under_bf16_weights() -> None:
    # A bf16 model keeps its residual stream in float32 (compute_service/model/model.py): the sum is
    # float32 (no rounding), and the norm's output, the next linear's input, is bf16, rounded once.
    gen = torch.Generator().manual_seed(7)
    weight = (1.0 + 0.1 * torch.randn(96, generator=gen)).bfloat16()
    eps = 1e-5
    residual = torch.randn(9, 96, generator=gen)
    for delta in (torch.randn(9, 96, generator=gen).bfloat16(), torch.randn(9, 96, generator=gen)):
        total = residual + delta.float()
        normed = ops.add_rms_norm(residual, delta, weight, eps)
        assert residual.dtype == torch.float32 and torch.equal(residual, total)
        want = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        close_to_float32(normed, want)
        close_to_float32(ops.rms_norm(residual, weight, eps), want)
    with pytest.raises(RuntimeError, match="residual"):  # a bf16 residual under float32 weights: a bug
        ops.add_rms_norm(torch.randn(2, 96).bfloat16(), torch.randn(2, 96), weight.float(), eps)


@pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN to prepack weights with")
@pytest.mark.parametrize("rows", [5, 300, 601])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_with_rows_split_or_not_keeps_the_product(rows, dtype) -> None:
    """`packed_linear` (oneDNN on the prepacked weight; from 256 rows split between the threads for the
    shapes `packed_linear_calibrate` measured faster so, csrc/cpu_ops.cpp): split, every row, the last
    partial share included, is the float32 product of the same inputs; not split, oneDNN's own result,
    bit for bit. Forced both ways here (the measured choice is this CPU's)."""
    generator = torch.Generator().manual_seed(rows)
    out_features, in_features = 576, 320
    weight = (torch.randn(out_features, in_features, generator=generator) / 18).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    packed = cpu_linear.prepack(weight, calibrate=False)
    want = F.linear(x.float(), weight.float(), bias.float())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs two (the choice is kept per thread count)
    try:
        for split in (True, False):
            assert ops.packed_linear_calibrate(packed, int(split)) is split
            got = ops.packed_linear(x, packed, bias)
            assert got.shape == (rows, out_features) and got.dtype == dtype
            if dtype == torch.bfloat16:
                close_to_float32(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            if not split or rows < 256:
                assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))
    finally:
        ops.packed_linear_calibrate(packed, 0)
        torch.set_num_threads(threads)
