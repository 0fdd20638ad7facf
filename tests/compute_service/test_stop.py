"""The stop rules and the sequence's transitions, without a model: each rule, its precedence, and
the invariants the transitions keep."""

from __future__ import annotations

import pytest

from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import FinishReason, Sequence
from compute_service.engine.stop import check_stop

pytestmark = pytest.mark.unit

EOS = (2,)
MAX_POSITION = 64


def stop(token: int, num_output: int, params: SamplingParams, matched: str | None = None, num_prompt: int = 4):
    return check_stop(token, num_output, num_prompt + num_output, params, EOS, MAX_POSITION, matched)


def test_each_rule_and_its_reason() -> None:
    params = SamplingParams(max_tokens=8, stop_token_ids=(7,))
    assert stop(5, 1, params) is None
    assert stop(2, 1, params) == (FinishReason.EOS, None)
    assert stop(7, 1, params) == (FinishReason.STOP, 7)
    assert stop(5, 1, params, matched="\n\n") == (FinishReason.STOP, "\n\n")
    assert stop(5, 8, params) == (FinishReason.LENGTH, None)
    assert stop(5, 3, params, num_prompt=MAX_POSITION - 3) == (FinishReason.LENGTH, None)  # the model's length


def test_precedence_eos_then_stop_token_then_string_then_length() -> None:
    params = SamplingParams(max_tokens=3, stop_token_ids=(2, 7))
    assert stop(2, 3, params, matched="x") == (FinishReason.EOS, None)
    assert stop(7, 3, params, matched="x") == (FinishReason.STOP, 7)
    assert stop(5, 3, params, matched="x") == (FinishReason.STOP, "x")


def test_min_tokens_and_ignore_eos_hold_eos_and_stop_tokens_back() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(7,))
    assert stop(2, 2, params) is None and stop(7, 2, params) is None
    assert stop(2, 3, params) == (FinishReason.EOS, None)
    assert stop(2, 3, SamplingParams(max_tokens=8, ignore_eos=True)) is None


def _seq(prompt: list[int]) -> Sequence:
    return Sequence("s/0", "r", prompt, SamplingParams(max_tokens=4))


def test_transitions_keep_the_counters_and_the_block_table() -> None:
    seq = _seq([10, 11, 12, 13, 14])
    seq.admit([3, 4], num_cached_tokens=4)
    assert (seq.num_cached_tokens, seq.num_computed_tokens, seq.block_table) == (4, 4, [3, 4])
    assert seq.advance(1)  # the whole prompt computed: sample
    seq.append_token(20)
    assert not seq.advance(0) and seq.tokens_to_compute(1) == [20]
    seq.extend_blocks([5], copies=[(4, 9)])
    assert seq.block_table == [3, 9, 5]
    child = _seq(seq.prompt_token_ids)
    seq.fork(child)
    assert (child.num_computed_tokens, child.block_table) == (5, [3, 9, 5]) and child.block_table is not seq.block_table
    with pytest.raises(AssertionError, match="computed more"):
        seq.advance(2)


def test_finish_once_and_no_token_after_it() -> None:
    seq = _seq([1])
    seq.finish(FinishReason.ABORT)
    with pytest.raises(AssertionError, match="finished twice"):
        seq.finish(FinishReason.LENGTH)
    with pytest.raises(AssertionError, match="after the finish"):
        seq.append_token(3)


def test_preempted_sequence_is_admitted_again_from_zero() -> None:
    seq = _seq([1, 2, 3])
    seq.admit([7], num_cached_tokens=0)
    with pytest.raises(AssertionError, match="admitted twice"):
        seq.admit([8], num_cached_tokens=0)
    seq.reset_for_recompute()
    seq.admit([8], num_cached_tokens=2)
    assert (seq.block_table, seq.num_computed_tokens, seq.num_preemptions) == ([8], 2, 1)
