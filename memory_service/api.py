"""What a client of the memory service needs, and nothing more: import from here.

The compute service (and tests, benchmarks) use the client, the ops it sends, the results and
statistics it gets, and the KV layout it attaches with. None of these loads the block manager,
its block pool or its prefix cache: those are the service's own.
"""

from __future__ import annotations

from memory_service.manager.block_types import (
    AllocateOp,
    AppendOp,
    BlockManagerStats,
    ForkOp,
    FreeOp,
    Op,
    OpResult,
    PoolStats,
    ReservedPool,
    StepResult,
    cache_namespace,
)
from memory_service.identity import KvTierInfo
from memory_service.client import MemoryClient, MemoryServiceUnavailable, channel_target
from memory_service.pool.kv_pool import KvLayout

__all__ = [
    "AllocateOp",
    "AppendOp",
    "BlockManagerStats",
    "ForkOp",
    "FreeOp",
    "KvLayout",
    "KvTierInfo",
    "MemoryClient",
    "MemoryServiceUnavailable",
    "Op",
    "OpResult",
    "PoolStats",
    "ReservedPool",
    "StepResult",
    "cache_namespace",
    "channel_target",
]
