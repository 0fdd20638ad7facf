"""The engine's view of its KV allocator: block bookkeeping and the pool tensor, wherever they live.

``Engine`` reads and calls exactly the members below, and nothing else. Two implementations:

- ``memory_service.client.MemoryClient``: the memory service in another process, one gRPC ``Step``
  per engine step, the pool mapped from shared memory (or a CUDA IPC handle). What the compute
  service and ``LLM`` run on.
- ``memory_service.in_process.InProcessAllocator``: the same ``MemoryCore`` (memory_service/core.py)
  in this process, a plain torch tensor as the pool. Nothing to start: unit tests of the scheduler
  and the engine, notebooks.

Both answer a step the same way (``StepResult``: one ``OpResult`` per op, out of blocks being a
normal ``ok=False``, and the available block counts after the step, clipped by the client's quota),
so the scheduler cannot tell them apart (tests/memory_service/test_allocator_parity.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from memory_service.api import Op, ReservedPool, StepResult

__all__ = ["KvAllocator", "StepResult"]


class KvAllocator(Protocol):
    """What an ``Engine`` needs from the owner of its KV blocks.

    Attributes:
        client_id: this engine's id at the allocator; sequence ids are ``f"{client_id}/{n}"``, unique
            among every client of a shared allocator.
        block_size: tokens per block.
        num_blocks: blocks in the pool, reserved ones included.
        reserved: the priority-reserved pool and who may take it (the memory service's rule).
        pool: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), the model's dtype
            and device: the K/V the model runner reads and writes.
    """

    client_id: str
    block_size: int
    num_blocks: int
    reserved: ReservedPool
    pool: torch.Tensor

    def step_with_counts(self, ops: Sequence[Op], prefill_tokens_per_s: float = 0.0) -> StepResult:
        """Apply one step's ops in order (a bad batch raises and changes nothing); one result per op,
        then the blocks available afterwards (general pool, reserved pool), and the sequences whose
        tier load ended (memory.proto's OpResult.loading). ``prefill_tokens_per_s``: the engine's
        measured prefill speed (0 = unknown), against which the allocator weighs a tier load."""
        ...
