"""Plain data of the block manager: its config, the ops a client sends, their results and stats.

Kept apart from ``block_manager`` so that a client (``memory_service.api``) gets them without the
block manager's logic, and the logic module stays short.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


def _require_int(name: str, value: object, minimum: int | None = None) -> None:
    # bool is an int subclass, but `num_blocks=True` is a caller bug, not one block.
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class ReservedPool:
    """The priority-reserved pool and who may take its blocks: the one owner of that rule.

    Both sides of the wire apply it: the block manager to every op (``OpApplier``), the compute
    side's scheduler when it plans a step with the counts the service sent (its plan must agree with
    what the service will grant, or it admits sequences whose ops then fail). The service sends
    its two numbers at attach; each side builds this object from them and asks it, never compares
    priorities itself.

    Args:
        num_blocks: blocks of the reserved pool (the top ids of the pool).
        min_priority: the lowest priority that may take them.
    """

    num_blocks: int = 0
    min_priority: int = 1

    def admits(self, priority: int) -> bool:
        """Whether a sequence of ``priority`` may take reserved blocks (once the general pool is empty)."""
        return priority >= self.min_priority

    def num_available_for(self, priority: int, num_general: int, num_reserved: int) -> int:
        """Blocks a sequence of ``priority`` may take, of ``num_general`` and ``num_reserved`` available."""
        return num_general + num_reserved if self.admits(priority) else num_general


@dataclass(frozen=True)
class BlockManagerConfig:
    """How the KV pool is split into blocks.

    Block ids ``[0, num_blocks - reserved_blocks)`` form the general pool, the top
    ``reserved_blocks`` ids ``[num_blocks - reserved_blocks, num_blocks)`` the priority-reserved
    pool, which only sequences with ``priority >= reserved_min_priority`` may take.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share and keep full blocks by content.
        reserved_blocks: blocks of the priority-reserved pool (< num_blocks: the general pool keeps one).
        reserved_min_priority: lowest priority allowed into the reserved pool.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    reserved_blocks: int = 0
    reserved_min_priority: int = 1

    def __post_init__(self) -> None:
        _require_int("num_blocks", self.num_blocks, 1)
        _require_int("block_size", self.block_size, 1)
        if type(self.enable_prefix_caching) is not bool:
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        _require_int("reserved_blocks", self.reserved_blocks, 0)
        if self.reserved_blocks >= self.num_blocks:
            raise ValueError(
                f"reserved_blocks must be < num_blocks ({self.num_blocks}) so the general pool keeps a block, "
                f"got {self.reserved_blocks}"
            )
        _require_int("reserved_min_priority", self.reserved_min_priority)

    @property
    def num_general_blocks(self) -> int:
        """Blocks of the general pool, ids ``[0, num_general_blocks)``."""
        return self.num_blocks - self.reserved_blocks

    @property
    def reserved_pool(self) -> ReservedPool:
        """The reserved pool's rule (see ``ReservedPool``)."""
        return ReservedPool(self.reserved_blocks, self.reserved_min_priority)


@dataclass(frozen=True)
class AllocateOp:
    """Create a sequence: share its cached prefix, then take blocks for its next tokens.

    Args:
        seq_id: new sequence id (unique among the client's live sequences; ids are per client).
        prompt_token_ids: the whole prompt (non-empty, ints in [0, 2**32)).
        max_num_new_tokens: token budget of this step (>= 1); blocks are taken for
            ``min(len(prompt) - num_cached_tokens, max_num_new_tokens)`` tokens, the rest of the
            prompt comes later through AppendOp (chunked prefill).
        priority: scheduling priority; ``>= reserved_min_priority`` may use the reserved pool.
        namespace: prefix-cache namespace (model name + cache_salt); only equal namespaces share.
        skip_cache_read: share nothing from the prefix cache (every prompt token is computed: a
            request that needs the logits at every prompt position); its full blocks are still
            registered, so later requests may share them.
    """

    seq_id: str
    prompt_token_ids: Sequence[int]
    max_num_new_tokens: int
    priority: int = 0
    namespace: str = ""
    skip_cache_read: bool = False


@dataclass(frozen=True)
class AppendOp:
    """Grow a sequence by tokens whose K/V is written in this step (a prompt chunk or a sampled token).

    Args:
        seq_id: a live sequence of the client.
        token_ids: the new tokens (non-empty, ints in [0, 2**32)).
    """

    seq_id: str
    token_ids: Sequence[int]


@dataclass(frozen=True)
class FreeOp:
    """End a sequence; its blocks lose a reference.

    Args:
        seq_id: a live sequence of the client.
    """

    seq_id: str


@dataclass(frozen=True)
class ForkOp:
    """Create a child sequence that shares every block of its parent (e.g. parallel sampling).

    Args:
        parent_seq_id: a live sequence of the client.
        child_seq_id: new sequence id.
    """

    parent_seq_id: str
    child_seq_id: str


Op = AllocateOp | AppendOp | FreeOp | ForkOp


def cache_namespace(model_name: str, cache_salt: str = "") -> str:
    """The prefix-cache namespace of a model and a request's cache_salt, for ``AllocateOp.namespace``.

    Unambiguous: the model name is length-prefixed, so no ``(model, salt)`` pair reads as another
    (``"m|a" + "b"`` vs ``"m" + "a|b"``). Bounded: the salt, which users choose, is hashed, so a long
    one costs the memory service nothing.

    Args:
        model_name: the served model's name.
        cache_salt: the request's salt ("" = none).

    Returns:
        ``"<len>:<model_name>|<salt digest or empty>"``.
    """
    salt = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32] if cache_salt else ""
    return f"{len(model_name)}:{model_name}|{salt}"


# Not frozen, unlike the ops: one is built per op on the hot path and a frozen dataclass takes ~3x
# as long to construct. Treat it as read-only all the same.
@dataclass(slots=True)
class OpResult:
    """What one op did.

    Args:
        ok: False when the op found too few free blocks; it then changed nothing.
        block_ids: AllocateOp and ForkOp: the whole block table; AppendOp: the blocks appended to
            the table; FreeOp: the table the sequence held (none when it was parked on a tier
            load). Empty when not ok.
        num_cached_tokens: AllocateOp: prompt tokens served from the prefix cache.
        num_new_tokens: AllocateOp: tokens that got blocks in this step beyond the cached ones.
        copies: AppendOp: ``(src, dst)`` copy-on-write pairs; ``dst`` replaced ``src`` at the same
            position of the table and already holds ``src``'s bytes.
        loading: AllocateOp, with ``ok=False``: its cached prefix continues in a tier below the
            pool and is being loaded; nothing was allocated. Send the same op again once the
            sequence is listed as loaded (``BlockManager.take_load_reports``; memory.proto's
            ``OpResult.loading``), or free it (a FreeOp: the tier forgets it) if it is dropped.
    """

    ok: bool
    block_ids: list[int]
    num_cached_tokens: int = 0
    num_new_tokens: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    loading: bool = False


class StepResult(NamedTuple):
    """Answer to one step (``MemoryCore.step``, the Step RPC): a result per op, the blocks available
    for the next step (the pool's count, clipped by what the client's quota still allows), and the
    sequences whose tier load ended (retry their AllocateOp: memory.proto's OpResult.loading)."""

    results: list[OpResult]
    num_available_blocks: int
    num_available_reserved_blocks: int
    loaded_seq_ids: Sequence[str] = ()


@dataclass(frozen=True)
class PoolStats:
    """Block counts of one pool; ``num_free + num_cached + num_used == num_total``.

    Args:
        name: "general" or "reserved".
        num_total_blocks: blocks of the pool.
        num_free_blocks: blocks with no content worth keeping.
        num_cached_blocks: evictable blocks: no reference, but a prefix-cache entry.
        num_used_blocks: blocks in at least one block table.
    """

    name: str
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier below the pool (memory.proto's TierStats says what each counts)."""

    kind: str
    num_blocks: int = 0
    num_bytes: int = 0
    capacity_bytes: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_bytes_written: int = 0
    num_bytes_read: int = 0
    num_write_errors: int = 0
    num_bad_files: int = 0
    num_loads: int = 0
    num_loads_skipped: int = 0
    num_blocks_missed: int = 0


@dataclass(frozen=True)
class BlockManagerStats:
    """A snapshot of the block manager.

    Args:
        pools: the general pool, then the reserved pool (always both; the latter may be empty).
        kv_utilization: tokens stored / token capacity of the used blocks (0.0 when none is used).
        fragmentation: unused slots / slots of the used blocks (0.0 when none is used).
        prefix_cache_queries: prompt tokens looked up in the prefix cache.
        prefix_cache_hits: prompt tokens served from it.
        num_evictions: cached blocks evicted so far.
        num_copy_on_writes: blocks copied on write so far.
        num_sequences: live sequences.
        num_clients: attached clients.
        block_size: tokens per block.
        tiers: the tiers below the pool, fastest first (empty without one).
    """

    pools: tuple[PoolStats, ...]
    kv_utilization: float
    fragmentation: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_copy_on_writes: int
    num_sequences: int
    num_clients: int = 0
    block_size: int = 0
    tiers: tuple[TierStats, ...] = ()

    @classmethod
    def empty(cls, block_size: int, num_clients: int = 0) -> BlockManagerStats:
        """Stats of a service that has no pool yet (before its first attach): all zeros."""
        pools = tuple(PoolStats(name, 0, 0, 0, 0) for name in ("general", "reserved"))
        return cls(pools, 0.0, 0.0, 0, 0, 0, 0, 0, num_clients, block_size)

    @property
    def general(self) -> PoolStats:
        """Stats of the general pool."""
        return self.pools[0]

    @property
    def reserved(self) -> PoolStats:
        """Stats of the priority-reserved pool."""
        return self.pools[1]

    @property
    def prefix_cache_hit_rate(self) -> float:
        """prefix_cache_hits / prefix_cache_queries (0.0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
