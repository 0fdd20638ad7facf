"""The block manager and a plain tensor pool in the caller's process: a KV allocator with no service.

``InProcessAllocator`` answers the engine's steps exactly as ``MemoryClient`` does (same ops, same
``StepResult``, the same ``BlockManager`` behind them), without a process, a socket or shared memory:
the pool is an ordinary torch tensor on the model's device. It is the engine's allocator in unit
tests (exact admission, preemption and block counts in milliseconds) and wherever one engine owns
its pool alone. Not shared between processes, and single-threaded like the block manager.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.dtypes import DTYPES

from memory_service.client import StepResult
from memory_service.manager.block_manager import BlockManager
from memory_service.manager.block_types import BlockManagerConfig, BlockManagerStats, Op, OpResult
from memory_service.pool.kv_pool import KvLayout


class InProcessAllocator:
    """A ``KvAllocator`` (compute_service/engine/allocator.py) around an in-process ``BlockManager``.

    Args:
        layout: the model's KV layout; its ``block_size`` must equal ``config.block_size``.
        config: pool size, prefix caching and the reserved pool (the block manager's own config).
        device: where the pool tensor lives ("cpu", "cuda", "cuda:N").
        client_id: the engine's client id (its sequence ids start with it).

    Raises:
        ValueError: the layout's and the config's block sizes differ.
    """

    def __init__(self, layout: KvLayout, config: BlockManagerConfig, *, device: str | torch.device = "cpu",
                 client_id: str = "local") -> None:
        if layout.block_size != config.block_size:
            raise ValueError(f"layout.block_size {layout.block_size} differs from config.block_size "
                             f"{config.block_size}")
        self.layout = layout
        self.client_id = client_id
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.reserved = config.reserved_pool
        # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): the memory service's layout.
        self.pool = torch.zeros(layout.shape(config.num_blocks), dtype=DTYPES[layout.dtype], device=device)
        self.block_manager = BlockManager(config, copy_block=self._copy_block)
        self.block_manager.add_client(client_id)

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: one block's K and V, every layer."""
        self.pool[:, :, dst].copy_(self.pool[:, :, src])

    def step_with_counts(self, ops: Sequence[Op]) -> StepResult:
        """Apply ops in order; one result per op (``ok=False`` = out of blocks), then the counts.

        Raises:
            InvalidArgument: a bad batch (a caller bug; nothing was applied).
        """
        results = self.block_manager.apply(self.client_id, ops)
        num_general, num_reserved = self.block_manager.num_available_blocks()
        return StepResult(results, num_general, num_reserved)

    def step(self, ops: Sequence[Op]) -> list[OpResult]:
        """Like ``step_with_counts``, the results only (``MemoryClient.step``)."""
        return self.step_with_counts(ops).results

    def commit(self) -> None:
        """The K/V of the last step is written: its full blocks may be shared (``MemoryClient.commit``)."""
        self.block_manager.commit(self.client_id)

    def block_table(self, seq_id: str) -> list[int]:
        """The whole block table of one of this client's sequences."""
        return self.block_manager.block_table(self.client_id, seq_id)

    def stats(self) -> BlockManagerStats:
        """The block manager's block, cache and client statistics."""
        return self.block_manager.stats()

    def check_integrity(self) -> str | None:
        """None when every invariant of the block manager holds, else the first broken one
        (``MemoryClient.check_integrity``'s answer)."""
        try:
            self.block_manager.check_integrity()
        except AssertionError as exc:
            return str(exc) or "integrity check failed"
        return None
