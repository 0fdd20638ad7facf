"""Shared fixtures: the real default model (loaded once per session) and tiny random-weight models.

The default model's converted copy lives in the persistent cache root ($PAGEDSERVE_CACHE_DIR or
~/.cache/pagedserve), so only the very first run on a machine pays the ~20 s conversion.
"""

from __future__ import annotations

import os
import sys

import torch

# Without a GPU, Triton kernels run under the interpreter; it must be chosen before anything
# (transformers included) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

# Under pytest-xdist (scripts/test.sh runs one worker per core, up to 4): each worker's in-process
# models, and the services it starts, get an equal share of the cores: two workers of two OpenMP
# threads each on two cores wait at every barrier for a thread that is not running.
_NUM_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _NUM_WORKERS > 1:
    _num_threads = max(1, len(os.sched_getaffinity(0)) // _NUM_WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_num_threads)
    torch.set_num_threads(_num_threads)

# Shape of every tiny test model: 2 layers, hidden 64, 4 query heads over 2 KV heads, vocab 128.
TINY_SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
TINY_VARIANTS = ("llama", "llama-tied", "llama3-rope", "qwen2", "mistral")


@dataclass(frozen=True)
class TinyModel:
    """A random-weight model saved with save_pretrained at `path`, and the transformers model itself
    (float32, eager attention) as the reference."""

    variant: str
    path: Path
    hf_model: torch.nn.Module


def _build_tiny(variant: str) -> torch.nn.Module:
    import transformers

    if variant == "qwen2":
        config = transformers.Qwen2Config(**TINY_SHAPE)
        model_class = transformers.Qwen2ForCausalLM
    elif variant == "mistral":  # head_dim decoupled from hidden / heads: 4 * 32 != 64
        config = transformers.MistralConfig(**TINY_SHAPE, head_dim=32, sliding_window=None)
        model_class = transformers.MistralForCausalLM
    else:
        extra = {
            "llama": {},
            "llama-tied": {"tie_word_embeddings": True},
            # Original context 64 puts the 8 rotary frequencies of head_dim 16 in all three bands.
            "llama3-rope": {"rope_theta": 500000.0, "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}},
        }[variant]
        config = transformers.LlamaConfig(**TINY_SHAPE, **extra)
        model_class = transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(TINY_VARIANTS.index(variant))
    model = model_class(config).eval()
    with torch.no_grad():  # biases start at zero and norms at one: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


@pytest.fixture(autouse=True)
def _int8_activations_restored():
    """Every test starts with the kernels' int8 activations on (their default): a quantized model's load
    chooses them for the whole process (compute_service/model/activation_check.py), and a model loaded
    by one test must not choose for the next. Only where the kernels were loaded at all (never loads or
    builds them)."""
    yield
    cpu_ops = sys.modules.get("pagedserve_kernels.cpu_ops")
    if cpu_ops is not None and cpu_ops.loaded() is not None:
        sys.modules["pagedserve_kernels.quant"].set_int8_activations(True)


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """Factory: `make_tiny_model("qwen2")` -> TinyModel, built and saved once per session."""
    built: dict[str, TinyModel] = {}

    def make(variant: str = "llama") -> TinyModel:
        if variant not in built:
            hf_model = _build_tiny(variant)
            path = tmp_path_factory.mktemp(f"tiny-{variant}")
            hf_model.save_pretrained(path)
            built[variant] = TinyModel(variant=variant, path=path, hf_model=hf_model)
        return built[variant]

    return make


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory):
    """The tiny random Llama with a byte-level tokenizer (pagedserve_testing.tiny_model) of the
    service, end-to-end and reliability tests, built once per session and only read."""
    from pagedserve_testing.tiny_model import build_service_model

    return build_service_model(tmp_path_factory.mktemp("service-model"))


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct, float32 on CPU), loaded once via the cache."""
    from compute_service.model.model_loader import load_model

    return load_model("default", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def default_hf_model(default_model):
    """transformers' model over the same converted directory (float32, its default attention): the
    reference of every default-model test, loaded once. Tests only run it, never change it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model.source.path, torch_dtype=torch.float32,
                                                local_files_only=True).eval()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``pytest -m unit``: a test module that marks no test ``unit`` is not even imported. Importing
    every module (the gateway's, the e2e clients', transformers, xgrammar, ...) to find the unit ones
    cost ~45 s of CPU, more than the unit tests themselves."""
    if (config.getoption("markexpr") == "unit" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "mark.unit" not in collection_path.read_text()
    return None  # pytest decides as usual


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked `cuda` on a machine without a GPU (scripts/gpu_checks.sh runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_checks.sh on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
