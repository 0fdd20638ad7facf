"""The real default model (SmolLM2-135M-Instruct) over the wire: greedy tokens equal transformers',
the streamed text equals the tokenizer's decode, and a gateway can rebuild the tokenizer (chat
template included) from Info and GetTokenizer alone. A few prompts x 16 tokens: two CPU cores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.compute.v1 import compute_pb2 as cpb

from tests.compute_service.service_fixtures import Services, running_services

# The real model on a busy 2-core machine can take far longer than the 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 16
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
RAW = ["The quick brown fox", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def services(default_model) -> Iterator[Services]:  # default_model: converted once, in the cache
    with running_services("default", memory_args=("--max-num-blocks", "256")) as services:
        yield services


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    tok = default_model.tokenizer
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    return [chat, *(tok.encode(text) for text in RAW)]


def test_greedy_over_the_wire_equals_transformers(services: Services, default_model, default_hf_model,
                                                  prompts) -> None:
    for prompt in prompts:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            want = default_hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                             do_sample=False)[0, len(prompt):].tolist()
        messages = services.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        tokens = [t for m in messages for t in m.token_ids]
        assert tokens == want
        text = "".join(m.text for m in messages)
        assert text == default_model.tokenizer.decode(tokens, skip_special_tokens=True)
        assert messages[-1].finish_reason in ("eos", "length")


def test_a_gateway_rebuilds_the_tokenizer_from_the_service(services: Services, default_model, prompts,
                                                          tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    info = services.stub.Info(cpb.InfoRequest())
    assert info.model_name == "SmolLM2-135M-Instruct" and info.vocab_size == default_model.config.vocab_size
    assert set(default_model.config.eos_token_ids) == set(info.eos_token_ids)
    for chunk in services.stub.GetTokenizer(cpb.GetTokenizerRequest()):
        with open(tmp_path / chunk.name, "ab") as f:
            assert f.tell() == chunk.offset
            f.write(chunk.data)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in info.tokenizer_files)
    rebuilt = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    chat = rebuilt.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert list(chat["input_ids"] if hasattr(chat, "keys") else chat) == prompts[0]
    assert info.chat_template == default_model.tokenizer.chat_template
    messages = services.generate(prompts[0], max_tokens=MAX_TOKENS, temperature=0.0)
    assert "Paris" in rebuilt.decode([t for m in messages for t in m.token_ids], skip_special_tokens=True)
