"""The CPU execution paths of the model, each against transformers.

The fused path (C++ paged attention, fused rotary / SiLU-mul / add+RMSNorm) with oneDNN-prepacked
weights runs whenever both are available, so the rest of the suite exercises it; here the fused path
on plain weights (F.linear) and the PyTorch fallback path (no compiler, other dtypes, unsupported
head sizes; plain weights) are forced and checked too, logits and greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from compute_service import LLM, SamplingParams
from compute_service.model.model_loader import load_model
import pagedserve_kernels as kernels
from pagedserve_kernels import cpu_linear, cpu_ops
from tests.compute_service.test_model import ATOL, RTOL, PagedSequences, random_tokens, reference_logits

FUSED_AVAILABLE = cpu_ops.load() is not None


@pytest.fixture(params=["fused", "fused-plain-weights", "pytorch"])
def cpu_path(request, monkeypatch) -> str:
    if request.param.startswith("fused") and not FUSED_AVAILABLE:
        pytest.skip("the fused CPU kernels could not be built here")
    if request.param == "fused" and not cpu_linear.available():
        pytest.skip("this torch has no oneDNN to prepack weights with")
    if request.param != "fused":
        monkeypatch.setenv("PAGEDSERVE_CPU_PREPACK", "0")
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_ops, "_state", {"ops": None})  # as if the build had failed
    return request.param


def test_weights_are_prepacked_once_and_not_held_twice(make_tiny_model) -> None:
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN to prepack weights with")
    tiny = make_tiny_model("llama")
    model = load_model(str(tiny.path), device="cpu", dtype="float32").model
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    for packed, weight in ((attn.qkv_packed, attn.qkv_weight), (attn.o_packed, attn.o_weight),
                           (mlp.gate_up_packed, mlp.gate_up_weight), (mlp.down_packed, mlp.down_weight)):
        assert packed is not None and packed.is_mkldnn and weight.numel() == 0
    assert model.lm_head_packed is not None
    with pytest.raises(ValueError, match="prepacked"):
        model.load_weights(tiny.hf_model.state_dict().items())


def test_the_fused_path_is_taken_when_available(make_tiny_model) -> None:
    if not FUSED_AVAILABLE:
        pytest.skip("the fused CPU kernels could not be built here")
    model = load_model(str(make_tiny_model("llama").path), device="cpu", dtype="float32").model
    args = (torch.zeros(3, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))
    assert kernels.plan_step(*args, dtype=model.dtype, head_dim=model.config.head_dim).name == "fused-cpu"
    cpu_ops._state["ops"], ops = None, cpu_ops._state["ops"]  # as if the build had failed
    try:
        assert kernels.plan_step(*args, dtype=model.dtype, head_dim=model.config.head_dim).name == "torch"
    finally:
        cpu_ops._state["ops"] = ops


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral"])
def test_prefill_chunk_and_decode_logits(make_tiny_model, variant: str, cpu_path: str) -> None:
    tiny = make_tiny_model(variant)
    model = load_model(str(tiny.path), device="cpu", dtype="float32").model
    prompt, other = random_tokens(19, seed=21), random_tokens(6, seed=22)
    paged = PagedSequences(model)
    paged.step({"long": prompt[:7], "other": other})  # fresh prompts
    other.append(5)
    logits = paged.step({"other": [5], "long": prompt[7:]})  # a decode and a chunk over cached context
    torch.testing.assert_close(logits, reference_logits(tiny, [other, prompt]), atol=ATOL, rtol=RTOL)


def test_engine_greedy_tokens_equal_transformers(make_tiny_model, cpu_path: str) -> None:
    tiny = make_tiny_model("llama")
    prompts = [random_tokens(n, seed=30 + n) for n in (3, 17, 9, 30)]
    # 20 blocks of 4 tokens for 4 sequences of up to 30 + 12 tokens: preemption and recompute too.
    with LLM(str(tiny.path), dtype="float32",
             block_size=4, max_num_blocks=20, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
        assert llm.engine.scheduler.num_preemptions > 0
    eos = tiny.hf_model.config.eos_token_id
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            want = tiny.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                          do_sample=False, pad_token_id=eos)[0, len(prompt):].tolist()
            if eos in want:  # transformers pads after EOS; the engine stops there
                want = want[: want.index(eos) + 1]
            assert out.token_ids == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])  # qwen2: biases on the QKV projection
@pytest.mark.parametrize("packed", [True, False])
def test_the_one_call_layer_stack_gives_the_layer_loops_bits(make_tiny_model, monkeypatch, variant: str, dtype: str,
                                                             packed: bool) -> None:
    # pagedserve_kernels/csrc's decoder_layers runs every layer's ops in one C++ call: the same kernels in the same
    # order as CausalLM's loop over its layers, so logits and the K/V written are equal, not close.
    if not FUSED_AVAILABLE:
        pytest.skip("the fused CPU kernels could not be built here")
    if packed and not cpu_linear.available():
        pytest.skip("this torch has no oneDNN to prepack weights with")
    if not packed:
        monkeypatch.setenv("PAGEDSERVE_CPU_PREPACK", "0")
    model = load_model(str(make_tiny_model(variant).path), device="cpu", dtype=dtype).model
    assert model.is_prepacked is packed
    _assert_one_call_gives_the_loops_bits(model, monkeypatch)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_the_one_call_layer_stack_runs_quantized_projections_as_the_loop_does(make_tiny_model, monkeypatch,
                                                                             variant: str, quantization: str) -> None:
    # Projections kept quantized go into the same C++ call (their parts and scales as decoder_layers' quant
    # operands), with the kernels and order of the layer loop.
    if not FUSED_AVAILABLE or cpu_ops.load().quant_linear_isa() != "avx512-bf16":
        pytest.skip("the quantized kernels need the fused CPU kernels built with AVX512-BF16")
    model = load_model(str(make_tiny_model(variant).path), device="cpu", dtype="bfloat16",
                       quantization=quantization).model
    assert model.layer_stack().quantized and model.layer_stack().quant_meta
    _assert_one_call_gives_the_loops_bits(model, monkeypatch)


def _assert_one_call_gives_the_loops_bits(model, monkeypatch) -> None:
    from pagedserve_kernels.cpu_attention import CpuAttentionPlan

    one_call = CpuAttentionPlan.run_layers
    num_one_calls = []

    def counted(self, *args):
        pending = one_call(self, *args)
        num_one_calls.append(pending is not None)
        return pending

    prompt, other = random_tokens(19, seed=41), random_tokens(6, seed=42)
    steps = [{"long": prompt[:7], "other": other}, {"other": [5], "long": prompt[7:]}, {"other": [9], "long": [3]}]
    runs = []
    for run_layers in (counted, lambda self, *args: None):  # one call; then layer by layer
        monkeypatch.setattr(CpuAttentionPlan, "run_layers", run_layers)
        paged = PagedSequences(model)
        runs.append(([paged.step(new) for new in steps], paged.kv_pool))
    assert num_one_calls == [True] * len(steps)
    (one_call_logits, one_call_pool), (loop_logits, loop_pool) = runs
    for got, want in zip(one_call_logits, loop_logits):
        assert torch.equal(got, want)
    assert torch.equal(one_call_pool, loop_pool)
