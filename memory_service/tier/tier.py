"""What a tier below the pool is to ``TierWorker`` and ``MemoryCore``: the members each reads, nothing else.

A tier keeps copies of committed blocks, keyed by their chained key (``manager/chain.py``) and
tagged with their namespace key, within a budget, and gives them back to a load. Two kinds, because
the worker moves bytes differently to each (``worker.py``'s docstring):

- ``MemoryTier`` (the host tier, ``host_tier.py``): memory-speed. The writer ``put``-s a committed
  block in while it copies (a memcpy), and a load copies straight out of the tier's own buffer: it
  ``acquire``-s the block (pinned: no put reuses its slot meanwhile) and ``release``-s it after.
- ``IoTier`` (the disk tier, ``disk_tier.py``): behind a device or a network. The writer copies a
  block once, into a buffer of the tier's own (``new_buffer``, the block at ``identity.payload_offset``),
  and writes that buffer later, between copies (``put_buffer``); a block it had no room to stage is
  written from a memory tier's copy (``put``). A load ``get``-s blocks on reader threads, several
  ahead of the one it copies.

The anchor is LMCache's storage-backend interface (``contains``, ``batched_submit_put_task``,
``get_blocking``, ``pin``/``unpin``, ``close``): ``__contains__`` is ``contains``; ``put``/``put_buffer``
are its put (a memory tier's is synchronous, an IO tier's buffer is queued by the worker rather than
by the tier, so that every tier's writes share the writer's one low-priority thread); ``acquire``/
``release`` are ``get`` with ``pin``/``unpin``; ``get`` is ``get_blocking``. No ``remove``: a tier
evicts by its own LRU, and a block's key names its bytes for good (a new content is a new key).

Every tier is written through (inclusive): each committed block goes to every tier that lacks it,
and a load reads each block from the fastest tier that holds it. The worker takes its tiers fastest
first, the memory tiers before the IO tiers. A third tier (another RAM pool, a remote store) plugs
in by implementing one of the two Protocols; the worker needs no edit
(tests/memory_service/test_tier_protocol.py plugs in one written in the test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import mmap

    import torch

    from memory_service.manager.chain import BlockOrigin
    from memory_service.tier.block_file import TierIdentity


@dataclass(frozen=True)
class TierCounters:
    """What a tier holds and has done: its share of ``TierStats`` (memory.proto says what each counts).

    Attributes:
        num_write_errors: blocks a put dropped (a write error; in a memory tier, every slot pinned by loads).
        num_bad_files: blocks found damaged and removed (0 where nothing can be damaged).
    """

    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    num_bytes_written: int
    num_bytes_read: int
    num_write_errors: int
    num_bad_files: int = 0


@runtime_checkable
class Tier(Protocol):
    """What every tier answers (``MemoryTier`` and ``IoTier`` add how its bytes move).

    Attributes:
        kind: its name in ``TierStats`` and the metrics ("host", "disk"); unique among the tiers.
        medium: its medium in KV events (manager/kv_events.py: "CPU", "DISK").
        identity: the model and layout it keeps blocks of; None until ``open``.
        num_slots: the blocks it can hold, once open.
        on_change: told of each block stored (True) or dropped (False), by the thread that did it
            (``MemoryCore`` sets it for KV events); None: nobody.
    """

    kind: str
    medium: str
    identity: TierIdentity | None
    num_slots: int
    on_change: Callable[[bytes, bool], None] | None

    def open(self, identity: TierIdentity, pin_memory: bool) -> int:
        """Binds the tier to a model and layout (``pin_memory``: the pool is on CUDA, page-lock what
        loads copy from). Returns a count of blocks for the caller's log: the host's slots, the
        disk's files found."""
        ...

    def __contains__(self, key: bytes) -> bool:
        """Whether it holds ``key`` (an in-memory lookup, no IO: the block manager asks under its lock)."""
        ...

    def counters(self) -> TierCounters:
        ...

    def close(self) -> None:
        """Its threads' last call: releases what another process may take (the disk's directory lock)."""
        ...


@runtime_checkable
class MemoryTier(Tier, Protocol):
    """A memory-speed tier: puts and reads inline, on the worker's threads."""

    def put(self, key: bytes, ns_key: bytes, block: torch.Tensor) -> bool:
        """Copies ``block`` (``identity.block_shape``, the pool's dtype, any device) in; True when the
        tier holds it afterwards, False when it was dropped."""
        ...

    def touch(self, key: bytes) -> None:
        """Makes a block it holds the most recently used (committed again: in use)."""
        ...

    def acquire(self, key: bytes, ns_key: bytes, make_young: bool = True) -> tuple[int, torch.Tensor] | None:
        """Pins ``key`` (in namespace ``ns_key``) for a copy out: ``(slot, view)``, None when not held.
        ``make_young``: the read counts as a use (False for the writer's copy to an IO tier)."""
        ...

    def release(self, slot: int, is_read: bool) -> None:
        """Ends ``acquire``'s pin; ``is_read``: the view was copied from (counted as bytes read)."""
        ...


@runtime_checkable
class IoTier(Tier, Protocol):
    """A tier behind IO: writes from staged buffers, reads on reader threads."""

    def new_buffer(self) -> mmap.mmap:
        """A buffer for ``put_buffer``, the block's bytes at ``identity.payload_offset``."""
        ...

    def put_buffer(self, key: bytes, ns_key: bytes, buffer: mmap.mmap, origin: BlockOrigin | None = None) -> bool:
        """Writes a block already in a ``new_buffer``; True when held afterwards, False when dropped.
        ``origin`` (chain.py): kept with it, for ``take_found`` after a restart (None: unknown)."""
        ...

    def put(self, key: bytes, ns_key: bytes, payload: memoryview, origin: BlockOrigin | None = None) -> bool:
        """Writes a block's ``identity.bytes_per_block`` bytes (a copy of them into its own buffer first)."""
        ...

    def take_found(self) -> list[tuple[bytes, bytes, BlockOrigin]]:
        """The blocks ``open`` found from an earlier service, each ``(key, namespace key, origin)``,
        whose origin holds and whose chain reaches its namespace's root through blocks held, parents
        first, each chain's blocks in a row (KV events announce them); empty after the first call."""
        ...

    def get(self, key: bytes, ns_key: bytes) -> memoryview | None:
        """The block's bytes, checked, in a writable buffer of their own (the loader views it as a
        tensor); None when missing or bad. Any thread, several at once."""
        ...
