"""Fair admission between tenants, on the scheduler alone: its plans applied by a
real in-process block manager, the sequences advanced by hand. Asserts admission order only.

Before: first come, first served within a priority, so tenant b's request waited for all of tenant
a's backlog (test_a_newcomer_gets_the_next_free_slot admitted a2 where b0 belongs).
"""

from __future__ import annotations

import pytest

from memory_service.api import ReservedPool
from memory_service.manager.block_manager import BlockManager, BlockManagerConfig
from compute_service.engine.config import EngineConfig
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.scheduler import Scheduler
from compute_service.engine.sequence import Sequence

pytestmark = pytest.mark.unit

BLOCK_SIZE = 4


class Harness:
    """A scheduler and the block manager that answers its steps; records admissions in order."""

    def __init__(self, max_num_seqs: int, num_blocks: int = 256) -> None:
        self.manager = BlockManager(BlockManagerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE))
        self.manager.add_client("c")
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=BLOCK_SIZE,
                              admission_watermark=0.0)
        self.scheduler = Scheduler(config, BLOCK_SIZE, num_blocks, ReservedPool())
        self.seqs: dict[str, Sequence] = {}
        self.admitted: list[str] = []

    def add(self, name: str, tenant: str, priority: int = 0) -> None:
        seq = Sequence(seq_id=name, request_id=name, prompt_token_ids=[1, 2, 3, 4, 5],
                       params=SamplingParams(max_tokens=100, temperature=0.0), priority=priority, tenant=tenant)
        self.seqs[name] = seq
        self.scheduler.add(seq)

    def step(self) -> None:
        plan = self.scheduler.schedule()
        results = self.manager.apply("c", plan.ops)
        self.scheduler.apply_results(plan, results, *self.manager.num_available_blocks())
        num_other = len(plan.forks) + len(plan.frees)
        for (op, seq), result in zip(plan.work, results[num_other:]):
            if type(op).__name__ == "AllocateOp" and result.ok:
                self.admitted.append(seq.request_id)
        for seq in self.scheduler.running:  # every running sequence computed its tokens and sampled one
            seq.num_computed_tokens = seq.num_tokens
            seq.output_token_ids.append(7)
        self.manager.check_integrity()

    def finish(self, name: str) -> None:
        self.scheduler.finish(self.seqs[name])
        self.step()


def test_a_newcomer_gets_the_next_free_slot() -> None:
    """Tenant a saturates both slots with 6 waiting behind; b's one request is admitted at the next
    free slot, not after a's backlog; then a's waiting ones take the slots again."""
    h = Harness(max_num_seqs=2)
    for i in range(6):
        h.add(f"a{i}", "a")
    h.step()
    assert h.admitted == ["a0", "a1"]
    h.add("b0", "b")
    h.step()
    assert h.admitted == ["a0", "a1"]  # no free slot: b waits, nothing is preempted for fairness
    h.finish("a0")
    assert h.admitted == ["a0", "a1", "b0"]
    h.finish("a1")
    h.finish("b0")
    assert h.admitted == ["a0", "a1", "b0", "a2", "a3"]


def test_waiting_tenants_take_turns_and_priority_comes_first() -> None:
    """Three tenants waiting with one slot freeing at a time: the one with the fewest running goes
    first (ties: the earliest arrival); a higher priority goes before any tenant's turn."""
    h = Harness(max_num_seqs=3)
    for i in range(3):
        h.add(f"a{i}", "a")
    for i in range(3):
        h.add(f"b{i}", "b")
    h.add("c0", "c")
    h.step()
    assert h.admitted == ["a0", "b0", "c0"]  # one each, in arrival order of their heads
    h.add("a-high", "a", priority=1)
    h.finish("b0")
    assert h.admitted[3:] == ["a-high"]  # priority first, though a already runs one
    h.finish("c0")
    assert h.admitted[4:] == ["b1"]  # b runs none now, a runs two
    h.finish("a0")
    assert h.admitted[5:] == ["a1"]  # a runs one (a-high), b one: a's head arrived first


def test_a_tenant_alone_uses_every_slot() -> None:
    h = Harness(max_num_seqs=4)
    for i in range(6):
        h.add(f"a{i}", "a")
    h.step()
    assert h.admitted == ["a0", "a1", "a2", "a3"]
    h.finish("a2")
    assert h.admitted[4:] == ["a4"]
