"""Fixtures of the engine tests that score or pool prompts against transformers."""

from __future__ import annotations

import pytest

from tests.compute_service.tiny_llama import build_tiny_llama, to_causal_lm


@pytest.fixture(scope="module")
def hf_model():
    """The tiny random Llama in transformers (the reference)."""
    return build_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def model(hf_model):
    """The same weights as our CausalLM, with its config (``in_process_engine(*model)``)."""
    return to_causal_lm(hf_model)
