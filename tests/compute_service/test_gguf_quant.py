"""A GGUF's quantized tensors served as they are (`--quantization auto`): each block type read back as
integers with per-group scales and mins that give gguf's own de-quantized values; a model whose
fused projections mix types (v at Q6_K beside q and k at Q4_K, as Q4_K_M files have) kept quantized
in the right rows; and the default model's own Q4_1 file answering the README's question."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compute_service.model import gguf_file, model_loader
from compute_service.model.gguf_quant import QUANTIZED_TYPES, MappedRows, file_quantization
from compute_service.model.model_loader import load_model
from pagedserve_kernels import cpu_ops, quant
from pagedserve_kernels.quant import QuantizedLinear, pack
from tests.compute_service.test_cpu_paths import _assert_one_call_gives_the_loops_bits
from tests.compute_service.test_gguf import PROMPT, _our_greedy, _random_blocks, write_gguf

needs_kernels = pytest.mark.skipif(cpu_ops.load() is None or cpu_ops.load().quant_linear_isa() != "avx512-bf16",
                                   reason="the quantized kernels need a build with AVX512-BF16")


def _one_tensor_file(path, qtype: str):
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up.weight", _random_blocks((96, 512), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path).tensors[0]


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
def test_every_block_type_reads_back_as_integers_and_scales(qtype, tmp_path):
    from gguf.quants import dequantize

    tensor = _one_tensor_file(tmp_path / f"{qtype}.gguf", qtype)
    found = file_quantization(tensor)
    values = torch.from_numpy(dequantize(np.array(tensor.data), tensor.tensor_type)).reshape(96, 512)
    group = 16 if qtype == "Q6_K" else 32
    bits = 4 if qtype.startswith("Q4") else 6 if qtype.startswith(("Q5", "Q6")) else 8
    assert found.type_name == qtype and found.bits == bits
    assert found.q.shape == (96, 512) and found.scale.shape == (96, 512 // group)
    low, high = {4: (0, 15), 6: (-32, 31), 8: (-128, 127)}[bits]
    assert low <= int(found.q.min()) and int(found.q.max()) <= high
    rebuilt = found.q.double() * found.scale.double().repeat_interleave(group, dim=1)
    if found.minimum is not None:
        rebuilt += found.minimum.double().repeat_interleave(group, dim=1)
    torch.testing.assert_close(rebuilt, values.double(), rtol=1e-6, atol=1e-9)
    if qtype.endswith("_K"):  # each scale (and min) a whole multiple of the block's d (-dmin)
        per = 256 // group
        for values_, factor in ((found.scale, found.scale_factor), (found.minimum, found.min_factor)):
            assert (values_ is None) == (factor is None)
            if factor is not None:
                assert factor.shape == (96, 512 // 256)
                multiples = values_ / factor.repeat_interleave(per, dim=1)
                assert torch.equal(multiples, multiples.round())
                assert multiples.abs().max() <= (128 if qtype == "Q6_K" else 63)  # Q6_K's sc: int8
    else:
        assert found.scale_factor is None and found.min_factor is None


def test_q8_0_and_q4_0_integers_are_the_blocks_bytes(tmp_path):
    """ggml's layouts, read directly: Q8_0 is (d f16, 32 int8); Q4_0 (d f16, 16 bytes: low nibbles are
    values 0-15, high nibbles 16-31), value (nibble - 8) * d."""
    q8 = _one_tensor_file(tmp_path / "q8.gguf", "Q8_0")
    blocks = np.array(q8.data).reshape(96, 16, 34)
    found = file_quantization(q8)
    assert torch.equal(found.q, torch.from_numpy(blocks[..., 2:].view(np.int8).reshape(96, 512)))
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    assert torch.equal(found.scale, torch.from_numpy(d))
    assert found.minimum is None
    q4 = _one_tensor_file(tmp_path / "q4.gguf", "Q4_0")
    blocks = np.array(q4.data).reshape(96, 16, 18)
    nibbles = np.concatenate([blocks[..., 2:] & 15, blocks[..., 2:] >> 4], axis=-1).reshape(96, 512)
    found = file_quantization(q4)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    assert torch.equal(found.q, torch.from_numpy(nibbles.astype(np.int8)))
    torch.testing.assert_close(found.minimum, torch.from_numpy(-8 * d), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "with_min"),
                         [(8, 16, False), (6, 16, False), (6, 32, True), (4, 32, True), (4, 32, False)])
def test_a_table_read_in_place_widens_as_the_packed_one(tmp_path, bits, group, with_min):
    """`MappedRows` against `quant_rows` of the same integers packed, bit for bit: 8- and 6-bit groups of
    16 without mins and negative scales (a Q6_K table: q = 0 gives +0.0 in both), 6-bit with mins, 4-bit
    with and without mins."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(bits + group + with_min)
    low, high = {8: (-128, 128), 6: (-32, 32), 4: (0, 16)}[bits]
    q = torch.randint(low, high, (96, 128), generator=generator, dtype=torch.int8)
    q[3, :group] = 0
    scale = torch.randn(96, 128 // group, generator=generator) * 0.01  # negative ones included
    tensors = {"emb.q": q, "emb.scale": scale}
    minimum = -torch.rand(96, 128 // group, generator=generator) if with_min else None
    if with_min:
        tensors["emb.min"] = minimum
    save_file(tensors, tmp_path / "table.safetensors")
    mapped = MappedRows(tmp_path / "table.safetensors", "emb", {"type": "Q6_K", "bits": bits})
    packed = QuantizedLinear((pack(q, scale, minimum, bits),), "Q6_K")
    ids = torch.tensor([3, 0, 95, 3, 50])
    assert torch.equal(mapped.rows(ids).view(torch.int32), packed.rows(ids).view(torch.int32))
    assert torch.equal(mapped.dequantize().view(torch.int32), packed.rows(torch.arange(96)).view(torch.int32))


@needs_kernels
def test_a_mixed_k_quant_file_is_served_quantized_in_the_right_rows(tmp_path, monkeypatch):
    """q/k Q4_K, v Q6_K (one fused projection, two parts), gate/up Q5_K, the head Q6_K, the embedding
    table Q4_K: what the model multiplies by is the file's de-quantized weight (K-quant scales exact:
    compact), q/k rows un-permuted as for the float copy, the one-call C++ layer stack gives the layer
    loop's bits, and its tokens follow the float model's."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    types = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
             "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q5_K", "blk.0.ffn_up.weight": "Q5_K",
             "blk.0.ffn_down.weight": "Q4_K", "output.weight": "Q6_K", "token_embd.weight": "Q4_K"}
    path = write_gguf(hf_model, tmp_path / "tiny-k.gguf", "F16", arch="llama", tensor_types=types)
    quantized = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="bfloat16")
    model = quantized.model
    assert model.quantization == "Q4_K+Q5_K+Q6_K"
    qkv = model.layers[0].attn.qkv_packed
    assert isinstance(qkv, QuantizedLinear) and [p.bits for p in qkv.parts] == [4, 6]
    assert model.lm_head_packed.parts[0].bits == 6  # Q6_K at 6 bits a weight, not int8's 8
    # every K-quant part holds its scales as multiples of the file's d (and mins of -dmin)
    assert all(part.compact for part in qkv.parts + model.lm_head_packed.parts)
    assert [p.out_features for p in qkv.parts] == [256 + 128, 128]
    assert model.embed_quantized is not None and model.embed_tokens.numel() == 0  # not widened in memory
    # Untied: read in place from the converted file, rows widened bit for bit as the packed table's are.
    assert isinstance(model.embed_quantized, MappedRows)
    table = model_loader.read_file_quantization(quantized.source.path)["model.embed_tokens.weight"]
    packed = QuantizedLinear((pack(table.q, table.scale, table.minimum, table.bits),), "Q4_K")
    ids = torch.tensor([0, 5, 127, 5, 64])
    assert torch.equal(model.embed_quantized.rows(ids).view(torch.int32), packed.rows(ids).view(torch.int32))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 128\), got \[5, 128\]"):
        model.embed_quantized.rows(torch.tensor([5, 128]))
    # Served at auto, nothing reads the quantized matrices' float32 copies: none were written.
    directory = quantized.source.path
    assert not list(directory.glob(f"{gguf_file.DEQUANTIZED_PREFIX}-*"))
    assert not (directory / gguf_file.DEQUANTIZED_MARKER).exists()
    assert {n for n, _ in model_loader._iter_weights(directory)} == {
        "model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"}
    model_loader.ensure_float_weights(quantized.source)  # as a float checkpoint's reader asks for them
    assert (directory / gguf_file.DEQUANTIZED_MARKER).is_file()
    floats = dict(model_loader._iter_weights(directory))
    assert len(floats) == 12  # the 3 norms, 9 matrices
    expected_qkv = torch.cat([floats[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    # compact: the file's d * sc and dmin * m exactly (float32 rounding apart)
    torch.testing.assert_close(qkv.dequantize(), expected_qkv, rtol=0, atol=float(expected_qkv.abs().max()) * 1e-6)
    # read in place: scale (d * sc) and min (dmin * m) rounded to float16, within 2^-11 of each, times q < 64
    table_floats = floats["model.embed_tokens.weight"]
    torch.testing.assert_close(model.embed_quantized.dequantize(), table_floats, rtol=0,
                               atol=float(table_floats.abs().max()) * 2e-3)
    assert model.layer_stack().quantized and model.layer_stack().quant_meta
    _assert_one_call_gives_the_loops_bits(model, monkeypatch)
    reference = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32",
                           quantization="none").model
    assert reference.quantization == "none"
    if quant.float_vnni():  # float32 activations at auto: the file's blocks, x split into two int8 parts
        precise = load_model(str(path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32").model
        assert precise.quantization == model.quantization and precise.embed_quantized is not None
        assert _our_greedy(precise, PROMPT, 8) == _our_greedy(reference, PROMPT, 8)
    assert quantized.fingerprint != load_model(str(path), cache_dir=tmp_path / "cache", device="cpu",
                                               dtype="bfloat16", quantization="none").fingerprint
    ours, theirs = _our_greedy(model, PROMPT, 8), _our_greedy(reference, PROMPT, 8)
    assert sum(a == b for a, b in zip(ours, theirs)) >= 6, (ours, theirs)


@needs_kernels
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_float_model_quantized_at_load_follows_its_float_tokens(scheme, make_tiny_model, tmp_path):
    tiny = make_tiny_model("qwen2")  # q/k/v biases: they ride in the quantized projection
    loaded = load_model(str(tiny.path), device="cpu", dtype="bfloat16", quantization=scheme)
    model = loaded.model
    assert model.quantization == ("int8" if scheme == "int8" else "int4+int8")  # the head at int8
    assert all(isinstance(layer.attn.qkv_packed, QuantizedLinear) and layer.attn.qkv_weight.numel() == 0
               for layer in model.layers)
    assert isinstance(model.lm_head_packed, QuantizedLinear) and model.lm_head_packed.parts[0].bits == 8
    reference = load_model(str(tiny.path), device="cpu", dtype="float32").model
    ours, theirs = _our_greedy(model, PROMPT, 8), _our_greedy(reference, PROMPT, 8)
    assert sum(a == b for a, b in zip(ours, theirs)) >= (7 if scheme == "int8" else 5), (ours, theirs)


def test_unknown_quantization_is_refused_by_name(make_tiny_model):
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4"):
        load_model(str(make_tiny_model("llama").path), device="cpu", dtype="bfloat16", quantization="int3")


@needs_kernels
def test_the_default_models_q4_1_file_served_quantized_answers_paris(tmp_path):
    from compute_service import LLM
    from compute_service.model.model_loader import default_gguf_path

    with LLM(model=str(default_gguf_path()), cache_dir=tmp_path, dtype="bfloat16", kv_cache_bytes=16 << 20) as llm:
        model = llm.engine.runner.model
        assert model.quantization == "Q4_1+Q8_0"  # the file's own blocks, not widened
        assert model.embed_quantized is model.lm_head_packed  # tied: the head's packed table, not read in place
        answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
                          temperature=0.0)
    assert "Paris" in answer.text
