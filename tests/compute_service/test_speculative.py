"""N-gram speculative decoding: the same greedy tokens as transformers, fewer steps.

The engine runs on a tiny random-weight Llama whose greedy outputs fall into loops quickly, so
drafts are proposed, many accepted and some rejected in every scenario below; each test checks
that they were (a test whose drafts never ran would prove nothing).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from compute_service import LLM, SamplingParams
from compute_service.engine import speculative
from compute_service.engine.scheduler import ScheduledSeq
from compute_service.engine.sequence import FinishReason, Sequence

from tests.compute_service.tiny_llama import VOCAB, hf_greedy, load_hf, save_tiny_llama



@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec"), seed=5)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> LlamaForCausalLM:
    return load_hf(tiny_dir)


def prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts with a repeated motif (drafts from the prompt) and random ones (drafts from the output)."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        if i % 2:
            motif = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(2, 6))]
            out.append((motif * 8)[: rng.randrange(8, 30)])
        else:
            out.append([rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))])
    return out


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.unit
def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    seq = Sequence("s", "r", [5, 6, 7, 8, 9, 5, 6, 7, 3, 4, 6, 7], SamplingParams(temperature=0.0))
    index = speculative.NgramIndex()
    # Suffix (6, 7): its latest earlier occurrence is at 5..7 (followed by 3, 4), not at 1..2.
    assert index.propose(seq, 3) == [3, 4, 6]
    # A longer suffix wins over a later short one: (9, 5, 6, 7) occurred once, followed by 3.
    seq.output_token_ids += [9, 5, 6, 7]
    assert index.propose(seq, 2) == [3, 4]  # the index caught up with the new output tokens
    assert index.propose(seq, 10) == [3, 4, 6, 7, 9, 5, 6, 7, 3, 4]  # past the end: around the loop
    assert speculative.NgramIndex().propose(Sequence("t", "r", [1, 2, 3], SamplingParams()), 4) == []
    # A loop of period 3: (2, 3, 1, 2) last occurred 3 back, followed by 3, 1, 2 and the end.
    loop = Sequence("l", "r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0))
    assert speculative.NgramIndex().propose(loop, 7) == [3, 1, 2, 3, 1, 2, 3]


@pytest.mark.unit
def test_drafts_fit_the_last_block_max_tokens_and_the_row_budget() -> None:
    seq = Sequence("s", "r", list(range(10)), SamplingParams(temperature=0.0, max_tokens=20))
    seq.output_token_ids = [3]
    seq.block_table = [7, 8, 9]  # 12 slots for 11 tokens: one draft fits in the last block
    assert speculative.room_for_drafts(seq, block_size=4, max_position=512) == 1
    seq.block_table.append(10)
    assert speculative.room_for_drafts(seq, block_size=4, max_position=512) == 5
    assert speculative.room_for_drafts(seq, block_size=4, max_position=13) == 1  # the model's length
    seq.output_token_ids = [3] * 18  # 19 of 20 tokens made: the last one needs no draft
    seq.block_table = list(range(8))
    assert speculative.room_for_drafts(seq, block_size=4, max_position=512) == 1
    seq.output_token_ids = [3] * 19
    assert speculative.room_for_drafts(seq, block_size=4, max_position=512) == 0
    assert speculative.draft_budget(8, 4) == 4 and speculative.draft_budget(48, 4) == 2
    assert speculative.draft_budget(200, 4) == 0 and speculative.draft_budget(0, 4) == 0
    assert speculative.accepted_prefix([4, 5, 6], [4, 5, 9, 2]) == 2
    assert speculative.accepted_prefix([4], [3, 4]) == 0


def decoding(seq_id: str, prompt: list[int], output: list[int], block_table: list[int],
             params: SamplingParams = GREEDY) -> ScheduledSeq:
    """A sequence scheduled for a one-token decode step (its last output token's K/V is computed now)."""
    seq = Sequence(seq_id, seq_id, prompt, params)
    seq.admit(block_table, 0)
    seq.advance(len(prompt))
    for token in output:
        seq.append_token(token)
    seq.advance(len(output) - 1)
    return ScheduledSeq(seq, 1)


def one_hot_rows(token_ids: list[int]) -> torch.Tensor:
    """(R, VOCAB) logits whose argmax in row r is token_ids[r]."""
    logits = torch.zeros(len(token_ids), VOCAB)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 1.0
    return logits


@pytest.mark.unit
def test_drafts_only_in_decode_steps_within_the_token_budget() -> None:
    loop = [5, 6, 7] * 3
    a = decoding("a", loop, [5], [0, 1, 2])  # 10 tokens in 3 blocks of 4: room for 1 draft... in 12 slots: 2
    b = decoding("b", loop, [5], [3, 4, 5])
    scheduled = [a, b]
    speculative.attach_drafts(scheduled, max_per_seq=4, max_num_batched_tokens=3, block_size=4, max_position=512)
    # 2 decodes leave 1 row of the 3-token budget: a takes it, b gets none.
    assert (a.draft_token_ids, b.draft_token_ids) == ([6], [])
    prompt = ScheduledSeq(Sequence("p", "p", [1, 2, 3], GREEDY), 3)  # a prompt chunk in the step
    c = decoding("c", loop, [5], [6, 7, 8])
    speculative.attach_drafts([c, prompt], max_per_seq=4, max_num_batched_tokens=64, block_size=4,
                              max_position=512)
    assert c.draft_token_ids == []


@pytest.mark.unit
def test_step_drafts_keep_the_agreed_prefix_and_one_more() -> None:
    a = decoding("a", [2, 3], [4], [0])
    b = decoding("b", [2, 3], [4], [1])
    plain = decoding("c", [2, 3], [4], [2])
    a.draft_token_ids, b.draft_token_ids = [10, 11, 12], [20, 21]
    # Rows: a, b, c after their last tokens, then a's 3 drafts, then b's 2.
    logits = one_hot_rows([10, 30, 40, 11, 99, 98, 31, 32])
    drafts = speculative.StepDrafts([a, b, plain], logits)
    assert drafts.num_draft_tokens == 5
    appended: list[tuple[str, int]] = []

    def appender(seq: Sequence):
        def append(token: int) -> None:
            appended.append((seq.seq_id, token))
            seq.append_token(token)
        return append

    # a: greedy 10 (its own row), then 11 after draft 10, 99 after draft 11: drafts 10, 11 accepted.
    assert drafts.append(0, a.seq, 10, appender(a.seq)) == 2
    # b: greedy 30 rejects draft 20 at once: only its own token.
    assert drafts.append(1, b.seq, 30, appender(b.seq)) == 0
    assert drafts.append(2, plain.seq, 40, appender(plain.seq)) == 0
    assert appended == [("a", 10), ("a", 11), ("a", 99), ("b", 30), ("c", 40)]
    assert a.seq.num_unappended_tokens == 2 and b.seq.num_unappended_tokens == 0


@pytest.mark.unit
def test_step_drafts_stop_where_the_sequence_finishes() -> None:
    a = decoding("a", [2, 3], [4], [0])
    a.draft_token_ids = [10, 11, 12]
    drafts = speculative.StepDrafts([a], one_hot_rows([10, 11, 12, 13]))

    def append(token: int) -> None:
        a.seq.append_token(token)
        if token == 11:  # a stop token: the sequence ends there
            a.seq.finish(FinishReason.STOP)

    # All 3 drafts agree, but the stop at the second ends the run: drafts 10 and 11 became output.
    assert drafts.append(0, a.seq, 10, append) == 2
    assert a.seq.output_token_ids == [4, 10, 11] and a.seq.num_unappended_tokens == 0


@pytest.mark.unit
def test_no_drafts_no_verdicts() -> None:
    a = decoding("a", [2, 3], [4], [0])
    drafts = speculative.StepDrafts([a], one_hot_rows([10]))
    assert drafts.num_draft_tokens == 0
    assert drafts.append(0, a.seq, 10, a.seq.append_token) == 0 and a.seq.output_token_ids == [4, 10]
    assert speculative.StepDrafts([], None).num_draft_tokens == 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_speculative_greedy_equals_transformers_and_caches_only_real_tokens(
        tiny_dir: Path, hf_model: LlamaForCausalLM, block_size: int) -> None:
    batch = prompts(8, seed=1)
    with LLM(str(tiny_dir), dtype="float32",
             block_size=block_size, max_num_blocks=512, num_speculative_tokens=4) as llm:
        first = llm.generate(batch, GREEDY)
        engine = llm.engine
        assert engine.num_accepted_draft_tokens > 0, "no draft was accepted: the test proves nothing"
        assert engine.num_draft_tokens > engine.num_accepted_draft_tokens, "no draft was rejected"
        steps = engine.num_steps
        # The outputs' blocks went to the prefix cache through the memory service's view of each
        # sequence: prompts extended by the outputs must hit them and still decode the same tokens.
        extended = [p + o.token_ids[:30] for p, o in zip(batch, first)]
        again = llm.generate(extended, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    want = [hf_greedy(hf_model, p, 40) for p in batch]
    assert [o.token_ids for o in first] == want
    assert steps < 40 + 8  # fewer steps than one token per step (a few are prefill)
    assert all(o.num_cached_tokens > len(p) for o, p in zip(again, batch))
    assert [o.token_ids for o in again] == [w[30:38] for w in want]


def test_speculation_with_preemption_and_stop_tokens(tiny_dir: Path, hf_model: LlamaForCausalLM) -> None:
    batch = prompts(8, seed=2)
    want = [hf_greedy(hf_model, p, 40) for p in batch]
    # 40 blocks of 4 tokens: too few for 8 sequences of up to 70 tokens at once.
    with LLM(str(tiny_dir), dtype="float32",
             block_size=4, max_num_blocks=40, max_num_seqs=8, num_speculative_tokens=4) as llm:
        outs = llm.generate(batch, GREEDY)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.num_accepted_draft_tokens > 0
        # A stop token that greedy decoding reaches mid-output, likely inside accepted drafts.
        stop = want[1][20]
        [stopped] = llm.generate([batch[1]], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop]))
        stats = llm.memory_stats()
    assert [o.token_ids for o in outs] == want
    assert stopped.token_ids == want[1][: want[1].index(stop) + 1] and stopped.finish_reason == "stop"
    assert stats.num_sequences == 0


@pytest.fixture(scope="module")
def llm16(tiny_dir: Path) -> Iterator[LLM]:
    """Blocks of 16, four drafts: shared by the tests that count drafts from where they start."""
    with LLM(str(tiny_dir), dtype="float32", block_size=16, max_num_blocks=256, num_speculative_tokens=4) as llm:
        yield llm


def test_only_plain_greedy_sequences_get_drafts(tiny_dir: Path, llm16: LLM) -> None:
    batch = prompts(4, seed=3)
    drafted = llm16.engine.num_draft_tokens
    for params in (SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True),
                   SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True),
                   SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.2, ignore_eos=True),
                   SamplingParams(max_tokens=30, temperature=0.0, n=2, ignore_eos=True)):
        llm16.generate(batch, params)
    assert llm16.engine.num_draft_tokens == drafted
    with LLM(str(tiny_dir), dtype="float32", block_size=16, max_num_blocks=256, num_speculative_tokens=0) as llm:
        llm.generate(batch, GREEDY)
        assert llm.engine.num_draft_tokens == 0  # turned off


def test_no_drafts_in_a_step_that_computes_a_prompt(llm16: LLM) -> None:
    every_token = list(range(VOCAB))  # whatever a's last token, it occurred before: a always drafts
    engine = llm16.engine
    assert not engine.has_unfinished()
    before = engine.num_draft_tokens
    engine.add_request("a", every_token, GREEDY)
    engine.step()  # a's prompt
    engine.step()  # a decodes with drafts
    drafted = engine.num_draft_tokens
    assert drafted > before, "a drafted nothing: the test proves nothing"
    engine.add_request("b", every_token[:20], GREEDY)
    engine.step()  # b's prompt with a's decode: bound by arithmetic, so no drafts
    assert engine.num_draft_tokens == drafted
    engine.step()  # both decode: drafts again
    assert engine.num_draft_tokens > drafted
    while engine.has_unfinished():  # the module's LLM is left idle
        engine.step()
