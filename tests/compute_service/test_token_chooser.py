"""The token chooser without an engine: rows of logits in, tokens out, a failing row failing its
request alone.

The grammars are real xgrammar matchers over a vocabulary built in code (tokens 10 and 11 spell
"a" and "b"); the one stand-in is a matcher whose mask cannot be filled, the fault that the
chooser must keep to its own request.
"""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from compute_service import SamplingParams
from compute_service.engine.config import EngineConfig
from compute_service.engine.sequence import FinishReason, Sequence
from compute_service.engine.token_chooser import TokenChooser
from compute_service.model.model_config import ModelConfig

from tests.compute_service.tiny_llama import EOS, VOCAB, tiny_hf_config

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=7)
A, B = 10, 11  # the grammar vocabulary's "a" and "b"


class FailedRequests:
    """The engine's ``fail_request`` for a chooser without an engine: records each call and ends the
    request's sequences with finish_reason "error", as the engine does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, type]] = []
        self.seqs: list[Sequence] = []

    def __call__(self, request_id: str, stage: str, exc: Exception) -> None:
        self.calls.append((request_id, stage, type(exc)))
        for seq in self.seqs:
            if seq.request_id == request_id:
                seq.fail()


class UnfillableMatcher:
    """A grammar matcher whose token mask cannot be filled (a fault of its own request's grammar)."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        raise RuntimeError("mask fill failed")


@pytest.fixture
def failed() -> FailedRequests:
    return FailedRequests()


@pytest.fixture
def chooser(failed: FailedRequests) -> TokenChooser:
    config = ModelConfig.from_hf(tiny_hf_config().to_dict(), name="tiny")
    return TokenChooser(config, None, EngineConfig(), failed)


@pytest.fixture(scope="module")
def ab_grammar() -> xgr.CompiledGrammar:
    vocab = [f"<{i}>" for i in range(VOCAB)]
    vocab[A], vocab[B] = "a", "b"
    return xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[EOS])).compile_regex("ab")


def make_seq(request_id: str, params: SamplingParams, failed: FailedRequests | None = None, **fields) -> Sequence:
    seq = Sequence(seq_id=f"{request_id}/0", request_id=request_id, prompt_token_ids=[3, 4, 5], params=params,
                   **fields)
    if failed is not None:
        failed.seqs.append(seq)
    return seq


def random_rows(num: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num, VOCAB, generator=torch.Generator().manual_seed(seed))  # (B, V)


def test_greedy_rows_take_the_argmax_and_a_logit_bias_moves_it_on_a_copy(chooser: TokenChooser) -> None:
    rows = random_rows(2)
    raw = rows.clone()
    biased = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((7, 100.0),))
    tokens = chooser.choose(rows, [make_seq("plain", GREEDY), make_seq("biased", biased)])
    assert tokens == [int(raw[0].argmax()), 7]
    assert torch.equal(rows, raw)  # the raw rows stay for logprobs and forks


def test_a_grammar_mask_leaves_only_its_tokens_and_accept_advances_it(chooser, ab_grammar) -> None:
    # Logprobs read the raw rows: the mask goes on a copy.
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    seq = make_seq("ab", params, matcher=xgr.GrammarMatcher(ab_grammar))
    rows = random_rows(1)
    rows[0, 50] = 100.0  # what the model wants, and the grammar forbids
    raw = rows.clone()
    chosen = []
    for _ in range(3):
        [token] = chooser.choose(rows, [seq])
        chooser.accept(seq, token)
        chosen.append(token)
    assert chosen == [A, B, EOS]  # "ab", then only the end
    assert torch.equal(rows, raw)
    with pytest.raises(RuntimeError, match="rejected sampled token 50"):
        chooser.accept(make_seq("fresh", params, matcher=xgr.GrammarMatcher(ab_grammar)), 50)


def test_a_row_the_sampler_fails_on_fails_its_request_alone(chooser, failed) -> None:
    # A frequency penalty over an output token outside the vocabulary: the batched sampler raises,
    # and the rows chosen one at a time give every other row its token as if it were alone.
    rows = random_rows(4)
    ok = make_seq("ok", GREEDY, failed)
    bad = make_seq("bad", SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.0), failed,
                   output_token_ids=[VOCAB + 5])
    seeded = make_seq("seeded", SEEDED, failed, generator=TokenChooser.new_generator(SEEDED, 0))
    gone = make_seq("gone", GREEDY, failed)
    gone.fail()  # its request failed in an earlier step: it gets nothing, and fails nothing again
    tokens = chooser.choose(rows, [ok, bad, seeded, gone])
    alone = make_seq("alone", SEEDED, generator=TokenChooser.new_generator(SEEDED, 0))
    assert tokens == [int(rows[0].argmax()), None, *chooser.choose(rows[2:3].clone(), [alone]), None]
    assert failed.calls == [("bad", "sampling", IndexError)]
    assert bad.finish_reason is FinishReason.ERROR and ok.finish_reason is None


def test_a_mask_that_cannot_be_filled_fails_its_request_alone(chooser, failed, ab_grammar) -> None:
    rows = random_rows(3)
    constrained = make_seq("ab", GREEDY, failed, matcher=xgr.GrammarMatcher(ab_grammar))
    broken = make_seq("broken", GREEDY, failed, matcher=UnfillableMatcher())
    plain = make_seq("plain", GREEDY, failed)
    argmax = int(rows[2].argmax())
    assert chooser.choose(rows, [constrained, broken, plain]) == [A, None, argmax]
    assert failed.calls == [("broken", "masking", RuntimeError)]


def test_only_a_seeded_random_request_gets_generators_one_stream_per_completion() -> None:
    unseeded = SamplingParams(max_tokens=8, temperature=0.8)
    greedy_seeded = SamplingParams(max_tokens=8, temperature=0.0, seed=7)
    assert TokenChooser.new_generator(unseeded, 0) is None and TokenChooser.new_generator(greedy_seeded, 0) is None

    def draws(index: int) -> list[int]:
        generator = TokenChooser.new_generator(SEEDED, index)
        return torch.randint(0, VOCAB, (8,), generator=generator).tolist()

    assert draws(0) == draws(0) and draws(0) != draws(1)
