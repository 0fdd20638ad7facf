"""bfloat16 as a CPU dtype: what ``auto`` picks, the fused path it runs, and its accuracy contract.

The contract (the kernels' own tolerance is in tests/kernels/test_cpu_ops_bf16.py): logits finite;
teacher-forced, our bf16 model's top-1 token agrees with transformers' bf16 model's at nearly every
position (not all: two bf16 implementations round differently, and where the top two logits are
within a rounding of each other either may win). The default model's rate over a few hundred
positions of English text is measured by benchmarks/bf16_agreement.py (docs/benchmarks.md).
"""

from __future__ import annotations

import copy

import pytest
import torch
from structlog.testing import capture_logs

import pagedserve_kernels as kernels
from pagedserve_kernels import cpu_linear, cpu_ops
from compute_service import LLM, SamplingParams
from compute_service.model.model_loader import load_model
from memory_service.pool.kv_pool import KvLayout
from pagedserve import dtypes
from tests.compute_service.test_model import PagedSequences, random_tokens

FUSED_AVAILABLE = cpu_ops.load() is not None
MIN_TOP1_AGREEMENT = 0.95


@pytest.mark.parametrize(("flags", "want"), [({"avx512f", "avx512_bf16"}, torch.bfloat16),
                                              ({"avx512f", "avx2"}, torch.float32)])
def test_auto_dtype_follows_the_cpu_and_is_logged(make_tiny_model, monkeypatch, flags, want) -> None:
    monkeypatch.setattr(dtypes.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: set(flags))
    path = str(make_tiny_model("llama").path)
    with capture_logs() as events:
        assert load_model(path, device="cpu").model.dtype == want
    [chosen] = [e for e in events if e["event"] == "dtype_auto"]
    assert chosen["dtype"] == dtypes.dtype_name(want) and chosen["device"] == "cpu"
    assert load_model(path, device="cpu", dtype="float32").model.dtype == torch.float32  # explicit wins
    assert load_model(path, device="cpu", dtype="bfloat16").model.dtype == torch.bfloat16


def test_bf16_model_runs_the_fused_path_on_packed_bf16_weights(make_tiny_model) -> None:
    if not FUSED_AVAILABLE or not kernels.can_prepack():
        pytest.skip("needs the fused CPU kernels and oneDNN")
    model = load_model(str(make_tiny_model("llama").path), device="cpu", dtype="bfloat16").model
    attn = model.layers[0].attn
    assert attn.qkv_packed is not None and attn.qkv_packed.is_mkldnn
    # The plain copy stays only for the small-batch kernel (decode), where this build has it.
    assert (attn.qkv_weight.numel() > 0) is kernels.keeps_plain(torch.bfloat16)
    if kernels.keeps_plain(torch.bfloat16) and cpu_linear.amx():  # kept in the AMX tiles' layout (same bytes)
        assert attn.qkv_weight.shape == (128 // 64, 64 // 2, 64, 2) and model.lm_head_small is not None
    assert attn.qkv_packed.dtype == torch.bfloat16
    args = (torch.zeros(3, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))
    assert kernels.plan_step(*args, dtype=torch.bfloat16, head_dim=model.config.head_dim).name == "fused-cpu"


def test_a_plain_copy_too_large_for_free_memory_is_not_kept(make_tiny_model, monkeypatch, caplog) -> None:
    if not FUSED_AVAILABLE or not kernels.can_prepack() or not kernels.keeps_plain(torch.bfloat16):
        pytest.skip("needs the fused CPU kernels, oneDNN and the small-batch linear")
    path = str(make_tiny_model("llama").path)
    kept = load_model(path, device="cpu", dtype="bfloat16").model
    weights = sum(kept.layers[0].attn.qkv_weight.nbytes for _ in kept.layers)  # less than every projection
    # 4 x the available memory is below the plain copy: packed weights alone, and a warning says so.
    monkeypatch.setattr(kernels.cpu_linear, "available_memory_bytes", lambda: weights)
    released = load_model(path, device="cpu", dtype="bfloat16").model
    assert "not keeping a plain copy" in caplog.text
    for layer in released.layers:
        assert layer.attn.qkv_weight.numel() == layer.mlp.down_weight.numel() == 0
        assert layer.attn.qkv_packed is not None and layer.mlp.down_packed is not None
    assert kept.layers[0].attn.qkv_weight.numel() > 0
    # Decode (one row: the small-batch kernel's size) runs on the packed weights, to the same tokens.
    tokens = random_tokens(24, seed=3)
    got = {}
    for name, model in (("kept", kept), ("released", released)):
        paged = PagedSequences(model)
        rows = [paged.step({"s": tokens[:16]})[0]] + [paged.step({"s": [t]})[0] for t in tokens[16:]]
        got[name] = torch.stack(rows)
    assert bool(torch.isfinite(got["released"]).all())
    assert (got["kept"].argmax(-1) == got["released"].argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_bf16_teacher_forced_top1_agrees_with_transformers_bf16(make_tiny_model, variant: str) -> None:
    tiny = make_tiny_model(variant)
    model = load_model(str(tiny.path), device="cpu", dtype="bfloat16").model
    hf = copy.deepcopy(tiny.hf_model).to(torch.bfloat16)
    tokens = random_tokens(80, seed=40)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()  # (80, vocab): after each position
    paged = PagedSequences(model)
    got = [paged.step({"s": tokens[:40]})[0]]  # a prefill (tile kernels), then teacher-forced decodes
    got += [paged.step({"s": [token]})[0] for token in tokens[40:-1]]
    got = torch.stack(got)  # (40, vocab): after positions 39..78
    assert bool(torch.isfinite(got).all())
    agreement = (got.argmax(-1) == want[39:-1].argmax(-1)).float().mean().item()
    print(f"{variant}: bf16 top-1 agreement with transformers bf16 {agreement:.3f}")
    assert agreement >= MIN_TOP1_AGREEMENT, agreement


def test_bf16_kv_pool_holds_twice_the_blocks_and_the_engine_generates(make_tiny_model) -> None:
    tiny = make_tiny_model("llama")
    kv_bytes = 1 << 20
    with LLM(str(tiny.path), dtype="bfloat16", block_size=4, kv_cache_bytes=kv_bytes) as llm:
        config = llm.model_config
        layouts = {name: KvLayout(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                                  head_dim=config.head_dim, dtype=name, block_size=4)
                   for name in ("float32", "bfloat16")}
        assert layouts["float32"].bytes_per_block == 2 * layouts["bfloat16"].bytes_per_block
        assert sum(pool.num_total_blocks for pool in llm.memory_stats().pools) == (
            kv_bytes // layouts["bfloat16"].bytes_per_block)
        [out] = llm.generate([random_tokens(9, seed=41)], SamplingParams(max_tokens=8, temperature=0.0,
                                                                         ignore_eos=True))
        assert len(out.token_ids) == 8


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_bf16_activations_round_far_less_than_a_plain_bf16_forward(make_tiny_model, variant: str) -> None:
    """A plain bf16 forward (transformers') flipped the README's near-tied first answer token.
    Ours keeps the residual stream, the logits and decode's projection outputs in float32 (bf16 weights,
    inputs to the linears and KV cache). Against the same bf16 weights computed in float32 (what no
    activation rounding would give), its logits must err far less than a plain bf16 forward's, over a
    prefill and teacher-forced decodes."""
    tiny = make_tiny_model(variant)
    model = load_model(str(tiny.path), device="cpu", dtype="bfloat16").model
    tokens = random_tokens(80, seed=42)
    plain = copy.deepcopy(tiny.hf_model).to(torch.bfloat16)
    exact = copy.deepcopy(plain).to(torch.float32)  # the bf16 weights, float32 arithmetic
    with torch.no_grad():
        want = exact(torch.tensor([tokens])).logits[0, 39:-1]  # after positions 39..78
        plain_logits = plain(torch.tensor([tokens])).logits[0, 39:-1].float()
    paged = PagedSequences(model)
    got = [paged.step({"s": tokens[:40]})[0]] + [paged.step({"s": [token]})[0] for token in tokens[40:-1]]
    ours_error = (torch.stack(got) - want).abs().mean().item()
    plain_error = (plain_logits - want).abs().mean().item()
    print(f"{variant}: mean |logit - exact|: ours bf16 {ours_error:.6f}, plain bf16 {plain_error:.6f}")
    assert ours_error < 0.75 * plain_error, (ours_error, plain_error)  # 0.57 here; 1.01 rounding as it does
