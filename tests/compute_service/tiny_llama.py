"""The engine tests' tiny random-weight Llama (vocabulary 256, EOS 1) and transformers' greedy
decoding of it, the reference every engine scenario must equal token for token; saved for ``LLM``
(which loads a directory), or built in memory with an ``Engine`` on the in-process allocator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compute_service.engine.config import EngineConfig
from compute_service.engine.engine import Engine
from compute_service.model.model import CausalLM
from compute_service.model.model_config import ModelConfig
from memory_service.api import KvLayout
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig

VOCAB = 256
EOS = 1


def save_tiny_llama(path: Path, seed: int) -> Path:
    """A 2-layer Llama with GQA, seeded weights, saved in Hugging Face format under ``path``."""
    build_tiny_llama(seed).save_pretrained(path)
    return path


def load_hf(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int, *, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy tokens: up to EOS, or ``max_tokens`` of them with ``ignore_eos``."""
    eos = {"eos_token_id": None} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=EOS, **eos)
    return out[0, len(prompt):].tolist()


def tiny_hf_config(max_position: int = 512) -> LlamaConfig:
    """The tiny Llama's config: 2 layers, 4 query heads over 2 KV heads of 16 dims, vocabulary 256."""
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position,
        bos_token_id=0, eos_token_id=EOS, tie_word_embeddings=False,
    )


def build_tiny_llama(seed: int) -> LlamaForCausalLM:
    """``save_tiny_llama``'s model built in memory, nothing written (the unit tests' reference)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_hf_config()).eval()


def to_causal_lm(hf_model: LlamaForCausalLM, name: str = "tiny") -> tuple[CausalLM, ModelConfig]:
    """Our model with ``hf_model``'s weights (float32, CPU), and its config, from memory."""
    config = ModelConfig.from_hf(hf_model.config.to_dict(), name=name)
    model = CausalLM(config)
    model.load_weights((name, tensor.detach().clone()) for name, tensor in hf_model.state_dict().items())
    return model.eval(), config


def in_process_engine(model: CausalLM, config: ModelConfig, *, num_blocks: int = 64, block_size: int = 4,
                      enable_prefix_caching: bool = True, reserved_blocks: int = 0, reserved_min_priority: int = 1,
                      **engine_config: Any) -> Engine:
    """An ``Engine`` on an ``InProcessAllocator`` (no memory service, no process) of ``num_blocks``
    blocks; ``engine_config``: EngineConfig fields (budgets, speculative tokens, watermark)."""
    layout = KvLayout(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      dtype="float32", block_size=block_size)
    allocator = InProcessAllocator(layout, BlockManagerConfig(
        num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
        reserved_blocks=reserved_blocks, reserved_min_priority=reserved_min_priority))
    return Engine(model, config, None, allocator, EngineConfig(block_size=block_size, **engine_config))
