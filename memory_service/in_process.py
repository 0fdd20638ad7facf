"""The block manager and a plain tensor pool in the caller's process: a KV allocator with no service.

``InProcessAllocator`` answers the engine's steps exactly as ``MemoryClient`` does (same ops, same
``StepResult``, the same ``MemoryCore`` behind them: tests/memory_service/test_allocator_parity.py),
without a process, a socket or shared memory: the pool is an ordinary torch tensor on the model's
device. It is the engine's allocator in unit tests (exact admission, preemption and block counts in
milliseconds) and wherever one engine owns its pool alone. Not shared between processes, and
single-threaded like the block manager (with a tier, its worker threads share the manager under the
core's lock, as in the service).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedserve.dtypes import DTYPES

from memory_service.config import DEFAULT_KV_DISK_BYTES
from memory_service.core import MemoryCore
from memory_service.manager.block_types import BlockManagerConfig, BlockManagerStats, Op, OpResult, StepResult
from memory_service.pool.kv_pool import KvLayout
from memory_service.tier.disk_tier import DiskTier, TierIdentity

if TYPE_CHECKING:
    from memory_service.manager.block_manager import BlockManager
    from memory_service.tier.tier import IoTier, MemoryTier
    from memory_service.tier.worker import TierWorker


class InProcessAllocator:
    """A ``KvAllocator`` (compute_service/engine/allocator.py) around an in-process ``MemoryCore``.

    Args:
        layout: the model's KV layout; its ``block_size`` must equal ``config.block_size``.
        config: pool size, prefix caching and the reserved pool (the block manager's own config).
        device: where the pool tensor lives ("cpu", "cuda", "cuda:N").
        client_id: the engine's client id (its sequence ids start with it).
        kv_disk_dir: a disk tier below the pool (memory_service/tier), as the service's
            ``--kv-disk-dir``; it needs ``model_fingerprint``. None: no tier.
        kv_disk_bytes: the disk tier's budget.
        kv_host_bytes: a host-RAM tier of this many bytes in front of the disk tier (or alone), as
            the service's ``--kv-host-bytes`` (page-locked on a CUDA pool); it needs
            ``model_fingerprint``. None: no host tier.
        kv_tiers: other tiers below the pool, made but not yet opened (memory_service/tier/tier.py's
            Protocols; ``MemoryCore.open_tiers``'s ``more``); they need ``model_fingerprint``.
        model_fingerprint: the model's fingerprint (compute_service/model/fingerprint.py).
        max_blocks: the client's quota of block-table entries, as the service's
            ``--max-blocks-per-client`` (``BlockManager.add_client``); None: none.

    Raises:
        ValueError: the layout's and the config's block sizes differ; a tier without a fingerprint;
            ``kv_host_bytes`` < 1.
    """

    def __init__(self, layout: KvLayout, config: BlockManagerConfig, *, device: str | torch.device = "cpu",
                 client_id: str = "local", kv_disk_dir: str | Path | None = None,
                 kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES, kv_host_bytes: int | None = None,
                 kv_tiers: Sequence[MemoryTier | IoTier] = (), model_fingerprint: str = "",
                 max_blocks: int | None = None) -> None:
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
        self.core = MemoryCore(config, self._copy_block)
        tier_identity = None
        if kv_disk_dir is not None or kv_host_bytes is not None or kv_tiers:
            if not model_fingerprint:
                raise ValueError("a KV tier (kv_disk_dir, kv_host_bytes, kv_tiers) needs a model_fingerprint: "
                                 "tier blocks are keyed by the model")
            if kv_host_bytes is not None and kv_host_bytes < 1:
                raise ValueError(f"kv_host_bytes must be >= 1, got {kv_host_bytes}")
            identity = TierIdentity(model_fingerprint, layout.dtype, layout.block_size, layout.num_layers,
                                    layout.num_kv_heads, layout.head_dim)
            disk = DiskTier(kv_disk_dir, kv_disk_bytes) if kv_disk_dir is not None else None
            self.core.open_tiers(identity, self.pool, host_bytes=kv_host_bytes, disk=disk, more=kv_tiers)
            tier_identity = identity.digest
        self.core.add_client(client_id, max_blocks, tier_identity)

    @property
    def block_manager(self) -> BlockManager:
        """The core's block manager (tests read it)."""
        return self.core.block_manager

    @property
    def tier(self) -> TierWorker | None:
        """The tiers' worker, when there is a tier."""
        return self.core.tier

    @property
    def _lock(self) -> threading.Lock:
        """The core's lock (tests hold it to read the block manager while a tier's threads run)."""
        return self.core.lock

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: one block's K and V, every layer."""
        self.pool[:, :, dst].copy_(self.pool[:, :, src])

    def step_with_counts(self, ops: Sequence[Op], prefill_tokens_per_s: float = 0.0) -> StepResult:
        """Apply ops in order; one result per op (``ok=False`` = out of blocks or quota; ``loading``:
        wait for the sequence in ``loaded_seq_ids``, then retry), then the counts (clipped by the
        quota, as the service's) and the ended loads (``MemoryCore.step``).

        Raises:
            InvalidArgument: a bad batch (a caller bug; nothing was applied).
        """
        return self.core.step(self.client_id, ops, prefill_tokens_per_s)

    def step(self, ops: Sequence[Op]) -> list[OpResult]:
        """Like ``step_with_counts``, the results only (``MemoryClient.step``)."""
        return self.step_with_counts(ops).results

    def commit(self) -> None:
        """The K/V of the last step is written: its full blocks may be shared (``MemoryClient.commit``)."""
        self.core.commit(self.client_id)

    def block_table(self, seq_id: str) -> list[int]:
        """The whole block table of one of this client's sequences."""
        return self.core.block_table(self.client_id, seq_id)

    def stats(self) -> BlockManagerStats:
        """The block manager's block, cache and client statistics (and the tier's)."""
        return self.core.stats()

    def close(self) -> None:
        """Stops the tier's threads (nothing else to release)."""
        self.core.close_tiers()

    def check_integrity(self) -> str | None:
        """None when every invariant of the block manager holds, else the first broken one
        (``MemoryClient.check_integrity``'s answer)."""
        return self.core.check_integrity()
