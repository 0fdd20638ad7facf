"""Fixtures of the structured-output tests: a tiny random-weight Llama over a byte-level tokenizer.

Every token is one byte, so JSON, regexes and choices are spelt out a byte at a time and a grammar
compiles in milliseconds. Its EOS is the tokenizer's special ``</s>`` (257): a random model
seldom picks it on its own, so a completion ends where the grammar makes EOS the only choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from compute_service import LLM
from pagedserve_testing.tiny_model import build_byte_tokenizer

EOS = 257
VOCAB = 258
PROMPTS = [[72, 101, 108, 108, 111, 58, 32], [123, 34, 97], [49, 50, 51, 45], [84, 104, 101, 32, 97, 110, 115]]


@dataclass(frozen=True)
class ByteModel:
    path: Path
    hf_model: torch.nn.Module
    tokenizer: object


@pytest.fixture(scope="session")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> ByteModel:
    return build_byte_model(tmp_path_factory.mktemp("byte-llama"))


def build_byte_model(path: Path) -> ByteModel:
    """The random-weight byte-tokenizer Llama, saved (weights and tokenizer) at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(20)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=256, eos_token_id=EOS,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(path)
    return ByteModel(path, model, tokenizer)


@pytest.fixture(scope="module")
def llm(byte_model: ByteModel) -> Iterator[LLM]:
    with LLM(str(byte_model.path), dtype="float32", block_size=4, max_num_blocks=1024) as engine:
        yield engine


def output_text(tokenizer, token_ids: list[int]) -> str:
    """The completion's text without its final EOS."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] == EOS else token_ids
    return tokenizer.decode(ids)


def hf_constrained_greedy(byte_model: ByteModel, compile_fn: Callable, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens under xgrammar's own logits processor, the grammar compiled by
    ``compile_fn(xgr.GrammarCompiler)`` from scratch (not through our compiler or its cache)."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    info = xgr.TokenizerInfo.from_huggingface(byte_model.tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
    processor = LogitsProcessor(compile_fn(xgr.GrammarCompiler(info, cache_enabled=False)))
    with torch.no_grad():
        out = byte_model.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, logits_processor=[processor],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()
