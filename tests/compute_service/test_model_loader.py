"""The loader: which directories load, what ModelConfig says, and the converted-model cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from compute_service.model import model_loader
from pagedserve.paths import CACHE_DIR_ENV, cache_dir
from compute_service.model.model_config import ModelConfig
from compute_service.model.model_loader import (
    DEFAULT_MODEL_NAME, load_model, resolve_model,
)


def test_missing_path_raises(tmp_path):
    with pytest.raises(ValueError, match="neither 'default' nor an existing local directory"):
        resolve_model(str(tmp_path / "nope"))


def test_hub_name_is_not_downloaded():
    with pytest.raises(ValueError, match="never downloads"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_unsupported_architecture_raises(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2'; supported: llama, mistral, qwen2"):
        load_model(str(tmp_path))


def test_directory_without_config_or_weights_raises(tmp_path, make_tiny_model):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    shutil.copy(make_tiny_model("llama").path / "config.json", tmp_path)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


def test_tiny_llama_loads_with_its_config(make_tiny_model):
    tiny = make_tiny_model("llama")
    loaded = load_model(str(tiny.path), device="cpu", dtype="float32")
    config = loaded.config
    assert (config.num_layers, config.num_q_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size, config.max_position) == (64, 96, 128, 256)
    assert config.name == tiny.path.name and config.model_type == "llama"
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.kv_pool_shape(10, 16) == (2, 2, 10, 16, 2, 16)
    assert loaded.tokenizer is None  # a random-weight directory has no tokenizer
    assert loaded.model.dtype == torch.float32 and loaded.model.device.type == "cpu"
    assert not loaded.source.was_converted


def test_variant_configs(make_tiny_model):
    qwen2 = load_model(str(make_tiny_model("qwen2").path), device="cpu", dtype="float32").config
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.model_type) == (True, False, "qwen2")
    mistral = load_model(str(make_tiny_model("mistral").path), device="cpu", dtype="float32").config
    assert mistral.head_dim == 32 and mistral.q_size == 128
    tied = load_model(str(make_tiny_model("llama-tied").path), device="cpu", dtype="float32")
    assert tied.config.tie_word_embeddings and tied.model.lm_head is tied.model.embed_tokens
    rope = load_model(str(make_tiny_model("llama3-rope").path), device="cpu", dtype="float32").config.rope
    assert (rope.scaling_type, rope.theta, rope.factor, rope.original_max_position) == ("llama3", 500000.0, 8.0, 64)


def test_dtype_argument(make_tiny_model):
    path = str(make_tiny_model("llama").path)
    assert load_model(path, device="cpu", dtype=torch.bfloat16).model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_model(path, device="cpu", dtype="int8")


def test_eos_ids_merge_generation_config_and_config():
    hf = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "intermediate_size": 96, "vocab_size": 128, "eos_token_id": 2}
    config = ModelConfig.from_hf(hf, name="x", generation_config={"eos_token_id": [7, 2]}, extra_eos_token_ids=(9,))
    assert config.eos_token_ids == (7, 2, 9)


def test_legacy_rope_keys_and_unsupported_scaling():
    hf = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "intermediate_size": 96, "vocab_size": 128, "rope_theta": 500000.0,
          "rope_scaling": {"type": "linear", "factor": 2.0}}
    rope = ModelConfig.from_hf(hf, name="x").rope
    assert (rope.theta, rope.scaling_type, rope.factor) == (500000.0, "linear", 2.0)
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelConfig.from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, name="x")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**hf, "hidden_act": "gelu"}, name="x")


# -- the converted-model cache, with a fast fake conversion instead of the 20 s GGUF one ----------


@pytest.fixture
def fake_conversion(monkeypatch, make_tiny_model) -> list[Path]:
    """Replace the GGUF conversion with a copy of the tiny model; returns the list of its calls."""
    calls: list[Path] = []

    def convert(out_dir: Path) -> None:
        calls.append(out_dir)
        shutil.copytree(make_tiny_model("llama").path, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(model_loader, "_convert_default_gguf", convert)
    return calls


def test_cache_dir_env_is_read_at_call_time(monkeypatch, tmp_path, fake_conversion):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert cache_dir() == tmp_path and cache_dir(tmp_path / "given") == tmp_path / "given"
    from pagedserve_kernels.cpu_ops import build_dir

    assert build_dir().parent == tmp_path / "cpu_ops"  # the kernels' build cache follows the same rule
    source = resolve_model("default")
    assert source.path == tmp_path / "models" / DEFAULT_MODEL_NAME and source.name == DEFAULT_MODEL_NAME
    monkeypatch.delenv(CACHE_DIR_ENV)
    assert cache_dir() == Path.home() / ".cache" / "pagedserve"


def test_conversion_runs_once_then_the_cache_is_used(tmp_path, fake_conversion):
    stale = tmp_path / "models" / f".tmp-{DEFAULT_MODEL_NAME}-crashed"
    stale.mkdir(parents=True)  # left behind by a killed conversion
    first = load_model("default", cache_dir=tmp_path, device="cpu", dtype="float32")
    second = resolve_model("default", cache_dir=tmp_path)
    assert first.source.was_converted and not second.was_converted
    assert len(fake_conversion) == 1
    left = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert left == [f".{DEFAULT_MODEL_NAME}.lock", DEFAULT_MODEL_NAME]  # the stale temp dir is gone
    assert first.config.name == DEFAULT_MODEL_NAME


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def crash(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")  # half written
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(model_loader, "_convert_default_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model("default", cache_dir=tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{DEFAULT_MODEL_NAME}.lock"]


def test_outdated_cache_is_rebuilt(tmp_path, fake_conversion):
    resolve_model("default", cache_dir=tmp_path)
    marker = tmp_path / "models" / DEFAULT_MODEL_NAME / model_loader.MARKER_FILE
    marker.write_text(json.dumps({"format": 0}))  # written by an older pagedserve
    assert resolve_model("default", cache_dir=tmp_path).was_converted
    assert len(fake_conversion) == 2 and json.loads(marker.read_text())["format"] == model_loader.CACHE_FORMAT_VERSION


@pytest.mark.slow
def test_default_model_config(default_model):
    config = default_model.config
    assert (config.num_layers, config.num_q_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert (config.hidden_size, config.vocab_size, config.tie_word_embeddings) == (576, 49152, True)
    assert config.rope.theta == 100000.0 and config.rope.scaling_type == "default"
    tok = default_model.tokenizer
    assert config.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
    assert "<|im_start|>" in tok.chat_template
    assert (default_model.source.path / "model.safetensors").is_file()
