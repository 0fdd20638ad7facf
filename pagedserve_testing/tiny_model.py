"""A tiny random-weight Llama with a byte-level tokenizer, built in seconds: the model of the
service, end-to-end and reliability tests and of the benchmarks' quick modes.

Every token is one byte, so multi-byte characters and stop strings straddle token boundaries all
the time. Its EOS token is the first token that transformers generates greedily for ``EOS_PROMPT``
at an index >= 3 and not before it, so every stop kind can be reached on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

EOS_PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "


@dataclass(frozen=True)
class ServiceModel:
    path: Path
    hf_model: torch.nn.Module
    tokenizer: object
    eos_token_id: int
    vocab_size: int


def build_byte_tokenizer():
    """A byte-level tokenizer without merges: 256 byte tokens, then <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return fast


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, EOS ignored."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, eos_token_id=None)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_tokens, "transformers stopped early: EOS was not ignored"
    return tokens


def build_service_model(directory: Path) -> ServiceModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    generated = hf_greedy(model, EOS_PROMPT, 12)
    eos = next(t for i, t in enumerate(generated) if i >= 3 and t not in generated[:i])
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(directory)
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(directory)
    return ServiceModel(directory, model, tokenizer, eos, 258)
