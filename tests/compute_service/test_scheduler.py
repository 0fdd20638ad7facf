"""The scheduler alone, on the in-process allocator: no model, no process.

Each test plans steps with ``Scheduler.schedule``, applies them with the memory service's own block
manager (``InProcessAllocator``) and reads the answers back with ``apply_results``, standing in for
the model with ``advance`` and a fixed sampled token, and asserts the exact ops, block tables,
admissions and preemptions of the rules in scheduler.py's docstring.
"""

from __future__ import annotations

import functools

import time
from pathlib import Path

import pytest

from compute_service import SamplingParams
from compute_service.engine.config import EngineConfig
from compute_service.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from compute_service.engine.sequence import FinishReason, Sequence
from memory_service.api import AllocateOp, AppendOp, ForkOp, FreeOp, KvLayout
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig

pytestmark = pytest.mark.unit

BLOCK_SIZE = 4
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_size=BLOCK_SIZE)
TOKEN = 7  # what the stand-in model "samples"


class Harness:
    """A scheduler and its allocator; ``step`` runs one step as the engine does, minus the model."""

    def __init__(self, num_blocks: int = 16, *, reserved_blocks: int = 0, enable_prefix_caching: bool = False,
                 **config: object) -> None:
        config.setdefault("admission_watermark", 0.0)
        self.allocator = InProcessAllocator(LAYOUT, BlockManagerConfig(
            num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching,
            reserved_blocks=reserved_blocks))
        a = self.allocator
        self.scheduler = Scheduler(EngineConfig(block_size=BLOCK_SIZE, **config), BLOCK_SIZE, a.num_blocks,
                                   a.reserved)
        self.last_plan = StepPlan()

    def add(self, name: str, num_prompt_tokens: int, *, priority: int = 0, max_tokens: int = 8) -> Sequence:
        seq = Sequence(seq_id=name, request_id=name, prompt_token_ids=[3] * num_prompt_tokens,
                       params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       priority=priority)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[ScheduledSeq]:
        plan = self.scheduler.schedule()
        self.last_plan = plan
        reply = self.allocator.step_with_counts(plan.ops)
        scheduled = self.scheduler.apply_results(plan, reply.results, reply.num_available_blocks,
                                                 reply.num_available_reserved_blocks)
        self.scheduler.loads_ended(reply.loaded_seq_ids)
        for item in scheduled:
            seq = item.seq
            if seq.advance(item.num_new_tokens):
                seq.append_token(TOKEN)
                if seq.num_output_tokens == seq.params.max_tokens:
                    seq.finish(FinishReason.LENGTH)
                    self.scheduler.finish(seq)
        assert self.allocator.check_integrity() is None
        return scheduled

    def names(self, queue: str) -> list[str]:
        return [s.seq_id for s in getattr(self.scheduler, queue)]

    def ops(self) -> list[tuple[str, str]]:
        """The last plan's ops as (type, seq id)."""
        return [(type(op).__name__, getattr(op, "seq_id", None) or op.child_seq_id) for op in self.last_plan.ops]


def test_waiting_sequences_are_admitted_first_come_first_served_within_the_budget() -> None:
    h = Harness(max_num_seqs=4, max_num_batched_tokens=16)
    a, b, c = h.add("a", 10), h.add("b", 6), h.add("c", 5)
    scheduled = h.step()
    # a takes 10 tokens, b the 6 left; c waits for the next step.
    assert [(s.seq.seq_id, s.num_new_tokens) for s in scheduled] == [("a", 10), ("b", 6)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4], [])
    assert h.names("running") == ["a", "b"] and h.names("waiting") == ["c"]
    assert h.scheduler.num_available_blocks == 16 - 5


def test_running_sequences_decode_before_anyone_is_admitted() -> None:
    h = Harness(max_num_seqs=4, max_num_batched_tokens=16)
    h.add("a", 10)
    h.add("b", 6)
    h.add("c", 5)
    h.step()
    scheduled = h.step()
    # a and b decode one token each (2 of the budget); c is admitted with what is left.
    assert h.ops() == [("AppendOp", "a"), ("AppendOp", "b"), ("AllocateOp", "c")]
    assert [(s.seq.seq_id, s.num_new_tokens) for s in scheduled] == [("a", 1), ("b", 1), ("c", 5)]


def test_a_long_prompt_is_cut_into_chunks_of_the_token_budget() -> None:
    h = Harness(max_num_seqs=2, max_num_batched_tokens=4)
    a = h.add("a", 10)
    tables = []
    for _ in range(3):
        h.step()
        tables.append(list(a.block_table))
    assert h.ops() == [("AppendOp", "a")]
    assert tables == [[0], [0, 1], [0, 1, 2]]
    assert (a.num_computed_tokens, a.num_output_tokens) == (10, 1)  # sampled once the prompt is done


def test_max_num_seqs_bounds_the_running_sequences() -> None:
    h = Harness(max_num_seqs=2)
    for name in "abc":
        h.add(name, 4)
    h.step()
    assert h.names("running") == ["a", "b"] and h.names("waiting") == ["c"]


def test_higher_priority_waits_at_the_head_of_the_queue() -> None:
    h = Harness(max_num_seqs=1)
    h.add("low", 4, priority=0)
    h.add("high", 4, priority=3)
    h.add("mid", 4, priority=1)
    assert h.names("waiting") == ["high", "mid", "low"]
    h.step()
    assert h.names("running") == ["high"]


def test_out_of_blocks_preempts_the_latest_arrival_of_the_lowest_priority() -> None:
    # 6 blocks: a and b hold 3 each from their 9th token on; a's 13th needs a 7th.
    h = Harness(num_blocks=6)
    a, b = h.add("a", 8), h.add("b", 8)
    for _ in range(5):  # the prompts, then the 9th to the 12th tokens
        h.step()
    assert (a.block_table, b.block_table) == ([0, 1, 4], [2, 3, 5]) and a.num_tokens == 13
    h.step()
    # a's append finds no block: b (same priority, later) is freed in this very step, a grows.
    assert h.ops() == [("FreeOp", "b"), ("AppendOp", "a")]
    assert h.scheduler.num_preemptions == 1 and b.num_preemptions == 1
    assert h.names("running") == ["a"] and h.names("waiting") == ["b"]
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert a.block_table == [0, 1, 4, 2]  # b's blocks came back tail first: its head (2) is reused first


def test_priority_outranks_arrival_when_choosing_whom_to_preempt() -> None:
    # a arrived first but has the lower priority: when both need a 4th block, a goes.
    h = Harness(num_blocks=6)
    a, b = h.add("a", 8, priority=0), h.add("b", 8, priority=1)
    for _ in range(6):
        h.step()
    assert h.names("running") == ["b"] and a.num_preemptions == 1 and b.num_preemptions == 0
    assert len(b.block_table) == 4


def test_waiting_sequence_preempts_only_strictly_lower_priorities() -> None:
    h = Harness(num_blocks=4, max_num_seqs=4)
    h.add("low", 12, priority=0)  # 3 of the 4 blocks (4 with its 13th token)
    h.step()
    h.add("same", 8, priority=0)
    h.step()
    assert h.names("waiting") == ["same"] and h.scheduler.num_preemptions == 0
    h.add("high", 8, priority=2)
    h.step()
    # high preempts low (strictly lower); the blocks it leaves serve same too, low waits in front.
    assert h.ops() == [("FreeOp", "low"), ("AllocateOp", "high"), ("AllocateOp", "same")]
    assert h.names("running") == ["high", "same"] and h.names("waiting") == ["low"]


def test_reserved_blocks_are_only_for_high_priorities() -> None:
    h = Harness(num_blocks=8, reserved_blocks=4)  # general 0..3, reserved 4..7 (priority >= 1)
    low = h.add("low", 15, priority=0)
    h.step()
    assert low.block_table == [0, 1, 2, 3]  # the general pool; its 16th token fits in block 3
    low2 = h.add("low2", 4, priority=0)
    high = h.add("high", 8, priority=1)
    h.step()
    assert high.block_table == [4, 5] and low2.block_table == []
    assert h.names("waiting") == ["low2"] and h.scheduler.num_preemptions == 0
    assert h.allocator.stats().reserved.num_used_blocks == 2


def test_admission_watermark_keeps_room_for_the_running_sequences() -> None:
    # 20 blocks, watermark 0.25: 5 blocks must stay free after an admission while others run.
    h = Harness(num_blocks=20, admission_watermark=0.25)
    assert h.scheduler.watermark_blocks == 5
    h.add("a", 40)  # 10 blocks
    h.step()
    h.add("b", 20)  # 5 blocks of the 9 left (a's 41st token took one): 4 would stay free, < 5
    h.step()
    assert h.names("waiting") == ["b"]
    h.add("alone", 4)
    h.scheduler.finish(h.scheduler.running[0])  # a ends: b is admitted with nothing left to grow
    h.step()
    assert h.names("running") == ["b", "alone"]


def test_a_paused_sequence_keeps_its_blocks_and_gets_no_tokens() -> None:
    h = Harness()
    a, b = h.add("a", 4), h.add("b", 4)
    h.step()
    a.is_paused = True
    h.step()
    h.step()
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 3) and a.block_table == [0]
    paused_waiting = h.add("c", 4)
    paused_waiting.is_paused = True
    h.step()
    assert h.names("waiting") == ["c"]


def test_finished_sequence_is_freed_by_the_next_step_and_counted_at_once() -> None:
    h = Harness(num_blocks=8)
    a = h.add("a", 8, max_tokens=1)
    h.step()  # a's prompt and its only token: finished
    assert a.is_finished and h.names("running") == []
    assert h.scheduler.num_available_blocks == 8 - 3 + 3  # its 3 blocks count as available already
    h.step()
    assert h.ops() == [("FreeOp", "a")]
    assert h.allocator.stats().num_sequences == 0 and not h.scheduler.has_work()


def test_a_failed_append_preempts_with_the_counts_the_service_gives() -> None:
    """Another client of the same pool took the blocks the plan counted on: the op fails and the
    sequence is preempted, freed by the next step, nothing lost."""
    h = Harness(num_blocks=4)
    a = h.add("a", 4)
    h.step()  # block 0, and its 5th token is computed next step in a new block
    manager = h.allocator.block_manager
    manager.add_client("other")
    manager.apply("other", [AllocateOp("x", [9] * 12, 12)])  # the 3 blocks left
    h.step()
    assert h.names("waiting") == ["a"] and a.num_preemptions == 1
    assert h.scheduler.num_available_blocks == 0  # the service's count, not the plan's
    h.step()
    assert h.ops() == [("FreeOp", "a")]


def test_a_fork_shares_the_parent_blocks_from_the_next_step() -> None:
    h = Harness()
    parent = h.add("p", 6)
    h.step()
    child = Sequence(seq_id="c", request_id="p", prompt_token_ids=parent.prompt_token_ids,
                     params=parent.params, index=1)
    parent.fork(child)
    child.append_token(TOKEN + 1)  # its own first token, sampled from the parent's row
    h.scheduler.add_fork(parent, child)
    h.step()
    assert h.ops() == [("ForkOp", "c"), ("AppendOp", "p"), ("AppendOp", "c")]
    # The parent writes its 8th token in the shared half-full block 1 first: copy-on-write gives it
    # block 2; the child then owns block 1 alone.
    assert parent.block_table == [0, 2] and child.block_table == [0, 1]
    assert h.allocator.stats().num_copy_on_writes == 1


def test_a_fork_that_finishes_before_the_service_forked_it_sends_nothing() -> None:
    h = Harness()
    parent = h.add("p", 6)
    h.step()
    child = Sequence(seq_id="c", request_id="p", prompt_token_ids=parent.prompt_token_ids, params=parent.params)
    parent.fork(child)
    h.scheduler.add_fork(parent, child)
    child.finish(FinishReason.ABORT)
    h.scheduler.finish(child)
    h.step()
    assert h.ops() == [("AppendOp", "p")]


def test_results_that_do_not_match_the_plan_are_a_bug() -> None:
    h = Harness()
    h.add("a", 4)
    plan = h.scheduler.schedule()
    with pytest.raises(RuntimeError, match="answered 0 results for 1 ops"):
        h.scheduler.apply_results(plan, [], 16, 0)


def test_plan_orders_forks_then_frees_then_work() -> None:
    plan = StepPlan(forks=[ForkOp("p", "c")], frees=[FreeOp("x")])
    seq = Sequence(seq_id="a", request_id="a", prompt_token_ids=[3], params=SamplingParams())
    plan.work.append((AppendOp("a", [3]), seq))
    assert plan.ops == [ForkOp("p", "c"), FreeOp("x"), AppendOp("a", [3])]


def _tier_harness(tmp_path: Path) -> Harness:
    """A harness whose in-process allocator has a 16-block pool and a disk tier in ``tmp_path``."""
    h = Harness(enable_prefix_caching=True)
    h.allocator = InProcessAllocator(LAYOUT, BlockManagerConfig(num_blocks=16, block_size=BLOCK_SIZE),
                                     kv_disk_dir=tmp_path, model_fingerprint="model")
    return h


def _add_greedy(h: Harness, name: str, prompt: list[int]) -> Sequence:
    """Queue a one-token greedy sequence named ``name``."""
    seq = Sequence(seq_id=name, request_id=name, prompt_token_ids=prompt,
                   params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    h.scheduler.add(seq)
    return seq


def _run_until(h: Harness, condition) -> None:
    """Step until ``condition()`` (tier writes and loads run on threads), for at most 30 s."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        h.step()
        time.sleep(0.01)


def test_a_sequence_loading_from_the_tier_is_parked_while_others_run(tmp_path: Path) -> None:
    """Rule 5: an admission answered ``loading`` waits, parked, the others are admitted meanwhile, and
    it is admitted (its prefix cached) once a step reports its load over."""
    h = _tier_harness(tmp_path)
    add, run_until = functools.partial(_add_greedy, h), functools.partial(_run_until, h)

    prompt = list(range(100, 113))  # 3 full blocks and a token
    a = add("a", prompt)
    run_until(lambda: a.is_finished and not h.scheduler.has_work())
    run_until(lambda: h.allocator.stats().tiers[0].num_blocks == 3)  # written behind
    evictor = add("e", list(range(200, 260)))  # 15 of the 16 blocks: a's cached blocks are evicted
    run_until(lambda: evictor.is_finished and not h.scheduler.has_work())
    b = add("b", prompt)
    add("c", list(range(300, 308)))
    scheduled = h.step()
    assert [item.seq.seq_id for item in scheduled] == ["c"]
    assert b.is_loading and h.names("waiting") == ["b"]
    run_until(lambda: b.num_cached_tokens)
    assert b.num_cached_tokens == 12 and not b.is_loading
    assert [op.seq_id for op in h.last_plan.ops if isinstance(op, AllocateOp)] == ["b"]
    h.allocator.close()


def test_a_sequence_finished_while_parked_on_a_load_is_freed_and_the_memory_service_forgets_it(
        tmp_path: Path) -> None:
    """Rule 5: a parked sequence that is aborted (before its load ends, or after, before its retry)
    is freed like any other, though it holds no blocks: the memory service's tier book keeps
    nothing of it (it kept each such seq_id until the client detached)."""
    h = _tier_harness(tmp_path)
    book = h.allocator.block_manager._tier
    add, run_until = functools.partial(_add_greedy, h), functools.partial(_run_until, h)

    def evict(name: str) -> None:
        evictor = add(name, list(range(200, 260)))  # 15 of the 16 blocks: the prompt's are evicted
        run_until(lambda: evictor.is_finished and not h.scheduler.has_work())

    prompt = list(range(100, 113))  # 3 full blocks and a token
    a = add("a", prompt)
    run_until(lambda: a.is_finished and not h.scheduler.has_work())
    run_until(lambda: h.allocator.stats().tiers[0].num_blocks == 3)  # written behind
    evict("e1")
    b = add("b", prompt)
    h.step()
    assert b.is_loading and b.has_tier_load
    h.scheduler.finish(b)  # aborted while its load runs
    h.step()
    assert h.ops() == [("FreeOp", "b")]
    run_until(lambda: not book.loads)
    evict("e2")
    c = add("c", prompt)
    run_until(lambda: not c.is_loading and c.has_tier_load)  # its load is over, its retry not sent
    h.scheduler.finish(c)
    h.step()
    assert h.ops() == [("FreeOp", "c")]
    assert (book.loaded, book.reports, book.loads) == ({"local": set()}, {"local": []}, {})
    # Admitted after its load: nothing left to free beyond its blocks.
    evict("e3")
    d = add("d", prompt)
    run_until(lambda: d.is_finished)
    assert d.num_cached_tokens == 12 and not d.has_tier_load
    assert (book.loaded, book.reports, book.loads) == ({"local": set()}, {"local": []}, {})
    h.allocator.close()
