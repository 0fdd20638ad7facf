"""The output processor without an engine: tokens in; logprobs, text, stops and deltas out.

A byte-level tokenizer built in code (every byte one token, EOS 257) gives real text and
stop strings; the requests are the engine's own ``Request`` objects, fed token by token as the
engine feeds them after each choice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from compute_service import SamplingParams
from compute_service.engine.detokenizer import IncrementalDetokenizer
from compute_service.engine.faults import DetokenizeFault, InjectedFault
from compute_service.engine.output_processor import OutputProcessor
from compute_service.engine.request import Completion, Request
from compute_service.engine.sequence import FinishReason, Sequence
from pagedserve_testing.tiny_model import build_byte_tokenizer

pytestmark = pytest.mark.unit

EOS = 257
VOCAB = 258
MAX_POSITION = 16
NO_LOGITS = torch.zeros(1, VOCAB)  # (1, V): read only for logprobs


class FailedRequests:
    """The engine's ``fail_request`` for a processor without an engine: records each call and ends
    the request with finish_reason "error", as the engine does (the scheduler aside)."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.calls: list[tuple[str, str, type]] = []

    def __call__(self, request_id: str, stage: str, exc: Exception) -> None:
        self.calls.append((request_id, stage, type(exc)))
        self.requests[request_id].fail(f"{stage} failed ({type(exc).__name__})")


class FlushFails(IncrementalDetokenizer):
    """A detokenizer whose final flush raises (a fault of its own request)."""

    def next_piece(self, is_finished: bool) -> str:
        if is_finished:
            raise RuntimeError("flush failed")
        return super().next_piece(is_finished)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_byte_tokenizer()


@pytest.fixture
def failed() -> FailedRequests:
    return FailedRequests()


@pytest.fixture
def processor(failed: FailedRequests) -> OutputProcessor:
    return OutputProcessor((EOS,), MAX_POSITION, failed)


def new_request(request_id: str, params: SamplingParams, tokenizer: Any, failed: FailedRequests,
                prompt: tuple[int, ...] = (72, 105), detokenizer: IncrementalDetokenizer | None = None,
                ) -> tuple[Request, Completion]:
    request = failed.requests[request_id] = Request(request_id, list(prompt), params, tokenizer)
    request.add_seq(Sequence(seq_id=f"{request_id}/0", request_id=request_id, prompt_token_ids=list(prompt),
                             params=params), detokenizer)
    return request, request.completions[0]


def feed(processor: OutputProcessor, completion: Completion, token_ids: list[int]) -> int | None:
    """Append tokens until one stops the sequence; the index of that one (None: none did)."""
    for i, token in enumerate(token_ids):
        if processor.append_token(completion, token, NO_LOGITS, 0):
            return i
    return None


def test_text_stops_at_a_stop_string_that_spans_tokens(processor, failed, tokenizer) -> None:
    params = SamplingParams(max_tokens=12, stop=("o w",))
    request, completion = new_request("r", params, tokenizer, failed)
    ids = tokenizer.encode("hello world")
    assert feed(processor, completion, ids) == len("hello w") - 1  # the token that completed "o w"
    assert completion.seq.finish_reason is FinishReason.STOP
    [delta] = processor.deltas([request])
    [out] = delta.completions
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("hell", ids[:7], "stop", "o w")
    assert delta.finished and delta.error is None


def test_each_delta_carries_only_the_news(processor, failed, tokenizer) -> None:
    request, completion = new_request("r", SamplingParams(max_tokens=12), tokenizer, failed)
    assert feed(processor, completion, tokenizer.encode("hi")) is None
    [first] = processor.deltas([request])
    assert (first.completions[0].text, first.finished) == ("hi", False)
    [idle] = processor.deltas([request])
    assert idle.completions == [] and not idle.finished
    bang = tokenizer.encode("!")
    assert feed(processor, completion, bang + [EOS]) == 1
    [last] = processor.deltas([request])
    [out] = last.completions
    assert (out.text, out.token_ids, out.finish_reason, last.num_completion_tokens) == ("!", bang + [EOS], "eos", 4)
    assert last.finished


@pytest.mark.parametrize("params, tokens, stopped_at, reason, stop_reason", [
    (SamplingParams(max_tokens=8), [65, EOS, 66], 1, "eos", None),
    # Under min_tokens neither EOS nor a stop token ends it (past it both do).
    (SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(66,)), [EOS, 66, EOS, 66], 3, "stop", 66),
    (SamplingParams(max_tokens=8, ignore_eos=True), [EOS] * 8, 7, "length", None),
    # The model's length: 2 prompt tokens + 14 reach MAX_POSITION before max_tokens.
    (SamplingParams(max_tokens=20), [65] * 20, 13, "length", None),
])
def test_the_stop_rules_end_the_sequence_at_the_first_rule_that_holds(
        processor, failed, tokenizer, params, tokens, stopped_at, reason, stop_reason) -> None:
    request, completion = new_request("r", params, tokenizer, failed)
    assert feed(processor, completion, tokens) == stopped_at
    [out] = processor.deltas([request])[0].completions
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens[:stopped_at + 1], reason, stop_reason)


def test_logprobs_come_from_the_row_the_token_was_chosen_from(processor, failed, tokenizer) -> None:
    request, completion = new_request("r", SamplingParams(max_tokens=8, logprobs=2), tokenizer, failed)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))  # (B, V); its row 1
    processor.append_token(completion, 65, logits, 1)
    [lp] = processor.deltas([request])[0].completions[0].logprobs
    want = torch.log_softmax(logits[1], dim=-1)
    assert lp.token_id == 65 and lp.logprob == pytest.approx(float(want[65]))
    assert lp.top_token_ids == want.topk(2).indices.tolist()


def test_a_detokenizer_failure_is_its_requests_alone(processor, failed, tokenizer) -> None:
    # While tokens arrive it raises to the engine, which ends the request; in the final flush the
    # processor ends it and still hands out its delta, beside the other requests' deltas.
    params = SamplingParams(max_tokens=2)
    fault = DetokenizeFault({(105,): 1}).detokenizer_for([72, 105], tokenizer, params.stop)
    _, streaming = new_request("streaming", params, tokenizer, failed, detokenizer=fault)
    assert feed(processor, streaming, [65]) is None
    with pytest.raises(InjectedFault):
        processor.append_token(streaming, 66, NO_LOGITS, 0)

    flushing, completion = new_request("flushing", params, tokenizer, failed,
                                       detokenizer=FlushFails(tokenizer, params.stop))
    fine, other = new_request("fine", params, tokenizer, failed)
    for c in (completion, other):
        assert feed(processor, c, [65, 66]) == 1
    with capture_logs() as events:
        bad, good = processor.deltas([flushing, fine])
    assert failed.calls == [("flushing", "detokenizing", RuntimeError)]
    assert (bad.finished, bad.error, bad.completions[0].finish_reason) == (True, "detokenizing failed (RuntimeError)",
                                                                           "error")
    assert bad.completions[0].token_ids == []  # never detokenized: never handed out
    text = tokenizer.decode([65, 66])
    assert (good.completions[0].text, good.completions[0].finish_reason, good.error) == (text, "length", None)
    finished = [(e["request_id"], e["reason"]) for e in events if e["event"] == "finished"]
    assert finished == [("flushing", "error"), ("fine", "length")]
