"""The two KV allocators answer alike: the same scripted steps through ``InProcessAllocator`` and
through a real memory service (``MemoryClient`` over its socket) give equal ``StepResult``s, step
for step: every op's result, both available-block counts, the loaded sequences.

Both stand on one ``MemoryCore`` (memory_service/core.py); this test keeps them from drifting again
(the service clipped the counts by the client's quota, the in-process allocator did not).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from memory_service.api import AllocateOp, AppendOp, ForkOp, FreeOp, MemoryClient, Op, StepResult
from memory_service.in_process import InProcessAllocator
from memory_service.manager.block_types import BlockManagerConfig
from tests.memory_service.conftest import TINY_LAYOUT, start_memory_service

NUM_BLOCKS, NUM_RESERVED = 16, 4  # the service's --max-num-blocks 16 --reserved-fraction 0.25
PROMPT = list(range(10))  # 2 full blocks + 2 tokens

# Each step's ops, sent as one Step. Covers sharing a cached prefix, growth with copy-on-write, a
# fork, the reserved pool, running into the client's quota (when there is one) and freeing. An op on
# a sequence that is not live (its AllocateOp ran out of blocks or quota) is left out of its step,
# and the last step frees whatever is still live.
SCRIPT: list[list[Op]] = [
    [AllocateOp("a", PROMPT, max_num_new_tokens=100)],
    [AllocateOp("b", PROMPT, max_num_new_tokens=100)],
    [ForkOp("a", "a2")],
    [AppendOp("a", [10, 11, 12]), AppendOp("a2", [20, 21, 22, 23])],
    [AllocateOp("c", list(range(100, 120)), max_num_new_tokens=8)],
    [AllocateOp("p", list(range(200, 216)), max_num_new_tokens=16, priority=1)],
    [AppendOp("c", list(range(120, 132)))],
    [FreeOp("b"), AllocateOp("d", PROMPT + [99], max_num_new_tokens=100)],
    [FreeOp("a"), FreeOp("a2"), FreeOp("c")],
    [AllocateOp("e", list(range(300, 330)), max_num_new_tokens=30)],
    [AppendOp("e", [330, 331]), AllocateOp("f", PROMPT, max_num_new_tokens=100)],
]


def _in_process(max_blocks: int | None) -> InProcessAllocator:
    config = BlockManagerConfig(num_blocks=NUM_BLOCKS, block_size=TINY_LAYOUT.block_size,
                                reserved_blocks=NUM_RESERVED, reserved_min_priority=1)
    return InProcessAllocator(TINY_LAYOUT, config, max_blocks=max_blocks)


def _live_only(ops: list[Op], live: set[str]) -> list[Op]:
    """``ops`` without those naming a sequence that is not live (an op on it would be a caller bug)."""
    return [op for op in ops if isinstance(op, AllocateOp) or (op.parent_seq_id if isinstance(op, ForkOp)
                                                                 else op.seq_id) in live]


def _update_live(live: set[str], ops: list[Op], result: StepResult) -> None:
    for op, op_result in zip(ops, result.results, strict=True):
        if isinstance(op, AllocateOp) and op_result.ok:
            live.add(op.seq_id)
        elif isinstance(op, ForkOp) and op_result.ok:
            live.add(op.child_seq_id)
        elif isinstance(op, FreeOp):
            live.discard(op.seq_id)


def _normalized(result: StepResult) -> StepResult:
    """One form for both: the client's loaded ids arrive as a list, the core's as any sequence."""
    return result._replace(loaded_seq_ids=list(result.loaded_seq_ids))


@pytest.fixture(params=[None, 6], ids=["no_quota", "quota_6"])
def allocators(request: pytest.FixtureRequest) -> Iterator[tuple[InProcessAllocator, MemoryClient]]:
    """The in-process allocator and a client of a fresh service, both with the same pool and quota."""
    max_blocks = request.param
    extra = ["--max-num-blocks", str(NUM_BLOCKS), "--reserved-fraction", "0.25"]
    if max_blocks is not None:
        extra += ["--max-blocks-per-client", str(max_blocks)]
    service, socket = start_memory_service(*extra)
    local = _in_process(max_blocks)
    try:
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, "parity") as remote:
            yield local, remote
            assert remote.check_integrity() is None
    finally:
        local.close()
        assert service.stop() == 0


def test_same_steps_give_the_same_results(allocators: tuple[InProcessAllocator, MemoryClient]) -> None:
    local, remote = allocators
    live: set[str] = set()
    num_refused = 0
    for number, script_ops in enumerate([*SCRIPT, None]):
        ops = _live_only(script_ops, live) if script_ops is not None else [FreeOp(s) for s in sorted(live)]
        expected = _normalized(remote.step_with_counts(ops))
        got = _normalized(local.step_with_counts(ops))
        assert got == expected, f"step {number} ({ops}) differs"
        assert local.check_integrity() is None
        _update_live(live, ops, expected)
        num_refused += sum(not r.ok for r in expected.results)
        local.commit()
        remote.commit()
    assert not live and local.stats().num_sequences == remote.stats().num_sequences == 0
    assert num_refused > 0  # the script reaches the pool's or the quota's end
