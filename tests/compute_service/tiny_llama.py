"""The engine tests' tiny random-weight Llama (vocabulary 256, EOS 1) and transformers' greedy
decoding of it, the reference every engine scenario must equal token for token."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
EOS = 1


def save_tiny_llama(path: Path, seed: int) -> Path:
    """A 2-layer Llama with GQA, seeded weights, saved in Hugging Face format under ``path``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=EOS, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def load_hf(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=EOS)
    return out[0, len(prompt):].tolist()
