"""The engine on the in-process allocator: no memory service, no process, no model file.

A tiny random Llama built in memory (tiny_llama.py) and an ``InProcessAllocator`` (the memory
service's own ``BlockManager`` over a plain tensor pool) make an ``Engine`` in milliseconds, so the
scheduling a service would do can be asserted exactly: which step admits whom, how many blocks each
sequence holds, who is preempted, and the tokens, equal to transformers' greedy decoding.

``ignore_eos`` keeps every length fixed, so the schedule does not depend on the random weights.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from transformers import LlamaForCausalLM

from compute_service import SamplingParams
from compute_service.engine.engine import Engine
from compute_service.engine.outputs import RequestOutput, collect
from compute_service.model.model import CausalLM
from compute_service.model.model_config import ModelConfig
from pagedserve.errors import AlreadyExistsError, InvalidArgument

from tests.compute_service.tiny_llama import VOCAB, build_tiny_llama, hf_greedy, in_process_engine, to_causal_lm

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model() -> LlamaForCausalLM:
    return build_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def tiny(hf_model: LlamaForCausalLM) -> tuple[CausalLM, ModelConfig]:
    return to_causal_lm(hf_model)


@functools.cache
def _reference(hf_model: LlamaForCausalLM, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return hf_greedy(hf_model, list(prompt), max_tokens, ignore_eos=True)  # as GREEDY does


def reference(hf_model: LlamaForCausalLM, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """transformers' greedy tokens past EOS (each prompt decoded once per session)."""
    return _reference(hf_model, tuple(prompt), max_tokens)


def prompts(num: int, seed: int, length: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(2, VOCAB) for _ in range(length or rng.randrange(1, 24))] for _ in range(num)]


def run(engine: Engine, requests: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    """Add every request, step until all finish; their tokens by id (the first completion's)."""
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        collect(results, engine.step())
    return {request_id: results[request_id].outputs[0].token_ids for request_id in requests}


def blocks_used(engine: Engine) -> int:
    return engine.memory.stats().general.num_used_blocks


def assert_intact(engine: Engine) -> None:
    assert engine.memory.check_integrity() is None


# --- token equality ---------------------------------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_equals_transformers(tiny, hf_model, enable_prefix_caching: bool) -> None:
    engine = in_process_engine(*tiny, num_blocks=128, enable_prefix_caching=enable_prefix_caching)
    batch = dict(enumerate(prompts(4, seed=1, shared_prefix=9)))
    batch = {f"r{i}": p for i, p in batch.items()}
    first = run(engine, batch)
    again = run(engine, {f"again-{k}": p for k, p in batch.items()})  # the prompts' blocks are cached now
    want = {k: reference(hf_model, p, 8) for k, p in batch.items()}
    assert first == want
    assert again == {f"again-{k}": v for k, v in want.items()}
    stats = engine.memory.stats()
    assert (stats.prefix_cache_hits > 0) is enable_prefix_caching
    assert stats.num_sequences == 0
    assert_intact(engine)


def test_chunked_prefill_equals_transformers(tiny, hf_model) -> None:
    [prompt] = prompts(1, seed=2, length=21)
    engine = in_process_engine(*tiny, max_num_seqs=2, max_num_batched_tokens=4)
    assert run(engine, {"a": prompt}) == {"a": reference(hf_model, prompt, 8)}
    # 21 prompt tokens in chunks of 4 (6 steps, the last samples the first token), 7 decodes, and
    # the step that frees the finished sequence's blocks.
    assert engine.num_steps == 6 + 7 + 1
    assert_intact(engine)


def test_speculative_drafts_keep_the_tokens(tiny, hf_model) -> None:
    # A repetitive prompt: the n-gram proposer finds drafts, and their verification keeps the tokens.
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = in_process_engine(*tiny, num_speculative_tokens=0)
    drafted = in_process_engine(*tiny, num_speculative_tokens=4)
    want = reference(hf_model, prompt, 16)
    assert run(plain, {"a": prompt}, params) == {"a": want}
    assert run(drafted, {"a": prompt}, params) == {"a": want}
    assert plain.num_draft_tokens == 0 and drafted.num_draft_tokens > 0
    assert drafted.num_steps <= plain.num_steps
    assert_intact(drafted)


def test_unseeded_rows_draw_without_the_full_vocabulary_multinomial(tiny, monkeypatch) -> None:
    # An unseeded request has no generator of its own: its rows take the nucleus draw, never the
    # seeded path's torch.multinomial over the whole vocabulary (~4 ms a row on the default model).
    # A seeded one still draws through it, and repeats its tokens.
    from compute_service.engine import sampler

    draws = []
    real = torch.multinomial
    monkeypatch.setattr(sampler.torch, "multinomial", lambda *a, **k: draws.append(1) or real(*a, **k))
    [prompt] = prompts(1, seed=3, length=9)
    engine = in_process_engine(*tiny, num_blocks=64)
    unseeded = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, ignore_eos=True)
    out = run(engine, {"u": prompt}, unseeded)
    assert len(out["u"]) == 6 and draws == []
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, ignore_eos=True, seed=5)
    first, again = run(engine, {"s": prompt}, seeded), run(engine, {"t": prompt}, seeded)
    assert first["s"] == again["t"] and len(draws) == 12
    assert_intact(engine)


# --- admission and blocks: exact counts -------------------------------------------------------


def test_admission_takes_the_blocks_of_the_scheduled_tokens(tiny) -> None:
    engine = in_process_engine(*tiny, num_blocks=32, num_speculative_tokens=0)
    engine.add_request("a", list(range(2, 12)), GREEDY)  # 10 tokens: 3 blocks of 4
    engine.add_request("b", list(range(20, 25)), GREEDY)  # 5 tokens: 2 blocks
    engine.step()
    a, b = (engine.requests[r].seqs[0] for r in "ab")
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    assert blocks_used(engine) == 5
    assert engine.load().kv_usage == pytest.approx(5 / 32)
    # Decodes: token 11 of a opens no block (its 3rd block has room for 2), token 6 of b neither.
    engine.step()
    engine.step()
    assert (len(a.block_table), len(b.block_table)) == (3, 2)
    engine.step()  # a's 13th token opens block 5
    assert a.block_table == [0, 1, 2, 5] and blocks_used(engine) == 6
    assert_intact(engine)


def test_max_num_seqs_leaves_the_rest_waiting(tiny) -> None:
    engine = in_process_engine(*tiny, max_num_seqs=2, num_speculative_tokens=0)
    for i in range(3):
        engine.add_request(f"r{i}", [3 + i] * 6, GREEDY)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["r0", "r1"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["r2"]
    assert engine.load().num_running == 2 and engine.load().num_waiting == 1


def test_token_budget_chunks_the_next_admission(tiny) -> None:
    engine = in_process_engine(*tiny, max_num_seqs=4, max_num_batched_tokens=12, num_speculative_tokens=0)
    engine.add_request("a", [3] * 8, GREEDY)
    engine.add_request("b", [4] * 8, GREEDY)
    engine.step()
    a, b = (engine.requests[r].seqs[0] for r in "ab")
    # a's 8 tokens, then b's first 4 (the budget left): b holds one block and samples nothing yet.
    assert (a.num_computed_tokens, b.num_computed_tokens) == (8, 4)
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)
    assert b.block_table == [2]


def test_prefix_cache_hit_is_counted_in_whole_blocks(tiny) -> None:
    engine = in_process_engine(*tiny)
    prompt = list(range(2, 16))  # 14 tokens: 3 full blocks
    run(engine, {"a": prompt})
    engine.add_request("b", prompt, GREEDY)
    engine.step()
    b = engine.requests["b"].seqs[0]
    assert b.num_cached_tokens == 12  # 3 full blocks; the last 2 tokens are computed again
    assert engine.load().prefix_cache_hit_rate == pytest.approx(12 / 28)


def test_preemption_by_recompute_when_blocks_run_out(tiny, hf_model) -> None:
    # 6 blocks of 4 = 24 slots for two sequences of 8 + 8 tokens each (4 blocks each at the end).
    batch = {"a": list(range(2, 10)), "b": list(range(30, 38))}
    engine = in_process_engine(*tiny, num_blocks=6, admission_watermark=0.0, num_speculative_tokens=0)
    got = run(engine, batch)
    assert got == {k: reference(hf_model, p, 8) for k, p in batch.items()}
    # Both hold 3 blocks after 9 tokens; a's 13th token needs a 7th block: b, the latest, goes, once.
    assert engine.scheduler.num_preemptions == 1
    assert engine.memory.stats().num_sequences == 0
    assert_intact(engine)


def test_higher_priority_preempts_a_running_lower_one(tiny, hf_model) -> None:
    low, high = list(range(2, 30)), list(range(40, 52))  # 7 blocks and 3 blocks
    engine = in_process_engine(*tiny, num_blocks=9, max_num_seqs=2, admission_watermark=0.0,
                               num_speculative_tokens=0)
    results: dict[str, RequestOutput] = {}
    engine.add_request("low", low, GREEDY, priority=0)
    collect(results, engine.step())  # low's whole prompt: 7 of the 9 blocks (and its first token)
    engine.add_request("high", high, GREEDY, priority=5)
    collect(results, engine.step())
    assert [s.request_id for s in engine.scheduler.running] == ["high"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["low"]
    assert engine.requests["low"].seqs[0].block_table == [] and engine.scheduler.num_preemptions == 1
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in collect(results, engine.step())]
    assert order == ["high", "low"]
    assert results["low"].outputs[0].token_ids == reference(hf_model, low, 8)
    assert results["high"].outputs[0].token_ids == reference(hf_model, high, 8)
    assert_intact(engine)


def test_reserved_blocks_serve_high_priority_only(tiny) -> None:
    # 8 general blocks and 4 reserved ones (ids 8..11); priority >= 1 may take them.
    engine = in_process_engine(*tiny, num_blocks=12, reserved_blocks=4, admission_watermark=0.0,
                               num_speculative_tokens=0)
    engine.add_request("low", [3] * 24, GREEDY, priority=0)  # 6 blocks
    engine.step()
    engine.add_request("low2", [4] * 12, GREEDY, priority=0)  # 3 blocks
    engine.add_request("high", [5] * 8, GREEDY, priority=1)  # 2 blocks
    engine.step()
    seqs = {r: engine.requests[r].seqs[0] for r in ("low", "low2", "high")}
    # low's 25th token takes block 6; high (first by priority) the last general block and a reserved
    # one; low2 finds no general block left, and may not preempt its equal.
    assert seqs["low"].block_table == list(range(7))
    assert seqs["high"].block_table == [7, 8]
    assert seqs["low2"].block_table == [] and [s.request_id for s in engine.scheduler.waiting] == ["low2"]
    assert engine.memory.stats().reserved.num_used_blocks == 1


def test_admission_watermark_keeps_room_to_grow(tiny) -> None:
    # 20 blocks, watermark 0.25: an admission must leave 5 blocks free while others run.
    engine = in_process_engine(*tiny, num_blocks=20, admission_watermark=0.25, num_speculative_tokens=0)
    engine.add_request("a", [3] * 40, GREEDY)  # 10 blocks
    engine.step()
    engine.add_request("b", [4] * 24, GREEDY)  # 6 blocks: 9 free, 3 left afterwards < 5
    engine.add_request("c", [5] * 4, GREEDY)  # FCFS: waits behind b
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["b", "c"]
    assert blocks_used(engine) == 11  # a's 41st token opened its 11th block


def test_parallel_sampling_forks_copy_the_shared_last_block(tiny, hf_model) -> None:
    prompt = list(range(2, 9))  # 7 tokens: the last block is half full, shared by the forks
    engine = in_process_engine(*tiny, num_speculative_tokens=0)
    engine.add_request("a", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3))
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        collect(results, engine.step())
    want = reference(hf_model, prompt, 8)
    assert [c.token_ids for c in results["a"].outputs] == [want] * 3
    # Two of the three write into the shared block first (the last one keeps it): 2 copies.
    assert engine.memory.stats().num_copy_on_writes == 2
    assert_intact(engine)


def test_abort_frees_the_blocks_at_the_next_step(tiny) -> None:
    engine = in_process_engine(*tiny)
    engine.add_request("a", [3] * 10, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    assert blocks_used(engine) == 3
    assert engine.abort("a") and not engine.abort("missing")
    [delta] = engine.step()
    assert (delta.request_id, delta.finished, delta.completions[0].finish_reason) == ("a", True, "abort")
    engine.step()
    assert blocks_used(engine) == 0 and not engine.has_unfinished()
    assert_intact(engine)


def test_bad_requests_are_refused_before_they_queue(tiny) -> None:
    engine = in_process_engine(*tiny, num_blocks=8)
    engine.add_request("a", [3, 4], GREEDY)
    with pytest.raises(AlreadyExistsError, match="request_id 'a'"):
        engine.add_request("a", [3, 4], GREEDY)
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        engine.add_request("b", [VOCAB + 1], GREEDY)
    with pytest.raises(InvalidArgument, match="KV pool"):  # 8 blocks of 4 hold 32 tokens, not 40
        engine.add_request("c", [3] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidArgument, match="stop"):  # no tokenizer, so no stop strings
        engine.add_request("d", [3], SamplingParams(stop=("x",)))
    assert list(engine.requests) == ["a"]


def test_paused_request_keeps_its_blocks_and_gets_no_tokens(tiny) -> None:
    engine = in_process_engine(*tiny, num_speculative_tokens=0)
    engine.add_request("a", [3] * 6, GREEDY)
    engine.add_request("b", [4] * 6, GREEDY)
    engine.step()
    engine.pause("a")
    for _ in range(3):
        engine.step()
    a, b = engine.requests["a"].seqs[0], engine.requests["b"].seqs[0]
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 4)
    assert a.block_table == [0, 1]
    engine.resume("a")
    engine.step()
    assert a.num_output_tokens == 2


def test_decodes_within_a_block_skip_the_memory_service_and_its_view_catches_up(tiny, hf_model) -> None:
    # scheduler.py's rule 7: a one-token decode that fits its last block without filling it is not
    # sent; the append that fills a block carries the tokens held back, so the prefix cache still
    # registers every full block of the output.
    engine = in_process_engine(*tiny, num_blocks=64, block_size=4, num_speculative_tokens=0)
    sent = []
    step_with_counts = engine.memory.step_with_counts

    def counted(ops, prefill_tokens_per_s=0.0):
        sent.append(ops)
        return step_with_counts(ops, prefill_tokens_per_s)

    engine.memory.step_with_counts = counted
    [prompt] = prompts(1, seed=7, length=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt, params)
    results: dict[str, RequestOutput] = {}
    num_steps = 0
    while engine.has_unfinished():
        collect(results, engine.step())
        num_steps += 1
        assert_intact(engine)
    output = results["a"].outputs[0].token_ids
    assert output == reference(hf_model, prompt, 24)
    # Prompt of 5: the admission, the first decode (it commits the prompt's full block), then per
    # block of 4 the token that fills it and the one that takes a new block; the free at the end.
    sent_steps = [[type(op).__name__ for op in ops] for ops in sent]
    assert len(sent) < num_steps
    assert sent_steps[:4] == [["AllocateOp"], ["AppendOp"], ["AppendOp"], ["AppendOp"]]
    assert [len(ops[0].token_ids) for ops in sent[1:4]] == [1, 2, 1]  # position 5; 6 (held back) + 7; 8
    assert sent_steps[-1] == ["FreeOp"]
    assert engine.memory.stats().num_sequences == 0
    # Every full block of prompt + output was registered: a prompt of the whole text finds them cached.
    engine.add_request("b", prompt + output, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        collect(results, engine.step())
    assert results["b"].num_cached_tokens == (len(prompt) + len(output) - 1) // 4 * 4
    assert_intact(engine)

