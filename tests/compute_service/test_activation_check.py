"""The load's choice of int8 activations (compute_service/model/activation_check.py), on real models:
the default model's Q4_1 file measures far from its bf16 activations and keeps those (its README
question sits on a near-tie int8 flips); a model whose int8 activations agree keeps them; the setting
is the kernels' (what `Info.kernel_paths` and the paths report)."""

from __future__ import annotations

import pytest

from compute_service.model import activation_check
from compute_service.model.model_loader import default_gguf_path, load_model
from pagedserve_kernels import cpu_ops, quant

pytestmark = pytest.mark.skipif(
    cpu_ops.load() is None or not quant.set_int8_activations(True),
    reason="int8 activations run on CPUs with AVX512-VNNI and no AMX tiles")


def test_the_default_models_q4_1_file_keeps_bf16_activations(tmp_path):
    loaded = load_model(str(default_gguf_path()), cache_dir=tmp_path, device="cpu", dtype="bfloat16")
    assert quant.vnni_rows() == 0 and quant.vnni_tile_rows() == 0  # what the load chose
    check = activation_check.choose_int8_activations(loaded.model, loaded.tokenizer)
    assert check is not None and not check.is_int8
    assert check.kl > 2 * activation_check.MAX_KL  # ~0.0027: not a coin toss at the threshold
    assert 100 < check.num_positions <= activation_check.MAX_TOKENS - activation_check.SKIP_POSITIONS
    assert quant.vnni_rows() == 0


def test_a_model_whose_int8_activations_agree_keeps_them(service_model):
    loaded = load_model(str(service_model.path), device="cpu", dtype="bfloat16", quantization="int8")
    quant.set_int8_activations(False)
    check = activation_check.choose_int8_activations(loaded.model, loaded.tokenizer)
    assert check is not None and check.is_int8 and 0 < check.kl <= activation_check.MAX_KL  # measured, and close
    assert quant.vnni_rows() > 0 and quant.vnni_tile_rows() > 0


def test_without_a_tokenizer_or_bf16_activations_nothing_is_measured(make_tiny_model, service_model):
    loaded = load_model(str(make_tiny_model("qwen2").path), device="cpu", dtype="bfloat16", quantization="int4")
    quant.set_int8_activations(False)
    assert activation_check.choose_int8_activations(loaded.model, None) is None
    assert quant.vnni_rows() == 0  # untouched
    float32 = load_model(str(service_model.path), device="cpu", dtype="float32", quantization="int8")
    assert activation_check.choose_int8_activations(float32.model, float32.tokenizer) is None
