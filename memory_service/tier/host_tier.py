"""The host tier: KV blocks kept in host RAM, in front of the disk tier (or alone).

One buffer of ``capacity_bytes // bytes_per_block`` slots, ``(num_slots, num_layers, 2, block_size,
num_kv_heads, head_dim)`` in the pool's dtype, allocated once when the tier opens (the layout is
known from the first trusted Attach). On a CUDA pool the buffer is page-locked (``pin_memory``): the
copies between it and the device run by DMA at the bus's speed, and a load's copies are issued
``non_blocking`` and waited for once. On a CPU pool it is plain host memory: there the tier is an
overflow of the pool that is cheaper than recomputing (a pool sized for the compute service's needs,
plus a larger RAM tier of cached blocks; a CPU pool lives in /dev/shm, the tier in ordinary pages).

Keys and namespaces are the disk tier's (``manager/chain.py``): a block's chained key names its whole prefix
in one model, layout and namespace; the namespace key is stored beside each block as well and
checked on every read, like the disk header's, so tenants stay apart even if a caller mixed keys.

LRU within the budget: a put takes a free slot, else the least recently used slot that no load is
reading; a read moves the block to the young end. Volatile: a restart starts empty (the disk tier is
what survives one).

Thread safety: one lock over the index, the slots' pins and the counters. ``put`` copies into a slot
under that lock (the writer calls it under the manager's lock too: lock order manager -> host).
``acquire`` pins a slot for a load and returns its view; the loader copies from it without the lock
and ``release``-s it after (after a device synchronisation on CUDA; its bytes count as read then): a
pinned slot is never reused, so a put never overwrites bytes a copy is still reading.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.dtypes import DTYPES
from pagedserve.log import get_logger

from memory_service.manager.kv_events import MEDIUM_HOST
from memory_service.tier.block_file import NAMESPACE_KEY_SIZE, TierIdentity
from memory_service.tier.tier import TierCounters

log = get_logger("memory_service.tier")


@dataclass(slots=True)
class _Entry:
    slot: int
    ns_key: bytes


class HostTier:
    """Block copies in one host buffer, LRU within a byte budget (module docstring); a ``MemoryTier``
    (tier.py).

    Args:
        capacity_bytes: the most its blocks may take together (>= 1).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_host_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.kind = "host"
        self.medium = MEDIUM_HOST
        self.identity: TierIdentity | None = None
        self.is_pinned = False
        self.num_slots = 0  # blocks it can hold, once open
        self._buffer: torch.Tensor | None = None  # (num_slots, *identity.block_shape)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._free_slots: list[int] = []
        self._pins: list[int] = []  # per slot: loads reading it now
        self._num_bytes_written = 0
        self._num_bytes_read = 0
        self._num_dropped = 0  # puts that found every slot pinned by loads
        # Told of each block stored (True) or dropped (False), under the tier's lock: KV events.
        self.on_change: Callable[[bytes, bool], None] | None = None

    def open(self, identity: TierIdentity, pin_memory: bool) -> int:
        """Allocates the buffer for a model and layout.

        Args:
            identity: the model and layout whose blocks the tier keeps.
            pin_memory: page-lock the buffer (a CUDA pool: module docstring).

        Returns:
            The number of blocks it can hold (0 when the budget is under one block: logged).
        """
        num_slots = self.capacity_bytes // identity.bytes_per_block
        if num_slots == 0:
            log.warning("kv_host_tier_holds_no_block", capacity_bytes=self.capacity_bytes,
                        bytes_per_block=identity.bytes_per_block, action="the host tier keeps nothing")
        buffer = torch.empty((num_slots, *identity.block_shape), dtype=DTYPES[identity.dtype],
                             pin_memory=pin_memory and num_slots > 0)
        with self._lock:
            self.identity = identity
            self.is_pinned = buffer.is_pinned() if num_slots else False
            self.num_slots = num_slots
            self._buffer = buffer
            self._index.clear()
            self._free_slots = list(range(num_slots - 1, -1, -1))  # slot 0 taken first
            self._pins = [0] * num_slots
        log.info("kv_host_tier_opened", num_slots=num_slots, capacity_bytes=self.capacity_bytes,
                 pinned=self.is_pinned)
        return num_slots

    # --- lookups ------------------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._index  # a dict lookup: atomic under the GIL

    def acquire(self, key: bytes, ns_key: bytes, make_young: bool = True) -> tuple[int, torch.Tensor] | None:
        """Pins the block ``key`` for a read (a load, or the writer's copy to the disk): its slot and
        a view of it, ``identity.block_shape``.

        Args:
            key: its chained key.
            ns_key: the namespace key it must carry (else a miss).
            make_young: count the read as a use (LRU); False for the writer's copy to the disk.

        Returns:
            ``(slot, view)``, or None when it is not here. Call ``release`` once copied (or not needed).
        """
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.ns_key != ns_key or self._buffer is None:
                return None
            if make_young:
                self._index.move_to_end(key)
            self._pins[entry.slot] += 1
            return entry.slot, self._buffer[entry.slot]

    def release(self, slot: int, is_read: bool) -> None:
        """Ends a load's pin of ``slot`` (``acquire``).

        Args:
            slot: the slot ``acquire`` answered.
            is_read: the load copied it (counted as bytes read); False for a block it pinned but
                never reached (it stopped on an earlier block no tier held any more).
        """
        with self._lock:
            self._pins[slot] -= 1
            if is_read:
                self._num_bytes_read += self.identity.bytes_per_block

    # --- writes -------------------------------------------------------------------------------

    def put(self, key: bytes, ns_key: bytes, block: torch.Tensor) -> bool:
        """Copies a block in (a synchronous copy, from the device on CUDA), evicting the least
        recently used unpinned block when full. A block already here is only made young.

        Args:
            key: its chained key.
            ns_key: its namespace key.
            block: ``identity.block_shape`` in the pool's dtype, on any device (a pool's block view).

        Returns:
            True when the block is in the tier afterwards; False when it was dropped (no slot).
        """
        identity = self.identity
        if identity is None or tuple(block.shape) != identity.block_shape or len(ns_key) != NAMESPACE_KEY_SIZE:
            raise ValueError("put: the tier is not open, or the block does not fit its identity")
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            slot = self._free_slot()
            if slot is None:
                self._num_dropped += 1
                return False
            self._buffer[slot].copy_(block)
            self._index[key] = _Entry(slot, ns_key)
            self._num_bytes_written += identity.bytes_per_block
            if self.on_change is not None:
                self.on_change(key, True)
        return True

    def _free_slot(self) -> int | None:
        """A free slot, else the least recently used block's that no load reads (evicted); under the lock."""
        if self._free_slots:
            return self._free_slots.pop()
        for key, entry in self._index.items():
            if self._pins[entry.slot] == 0:
                del self._index[key]
                if self.on_change is not None:
                    self.on_change(key, False)
                return entry.slot
        return None

    # --- state --------------------------------------------------------------------------------

    def touch(self, key: bytes) -> None:
        """Makes a block it holds the youngest (a block committed again: in use)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    def keys(self) -> list[bytes]:
        """The blocks held, least recently used first."""
        with self._lock:
            return list(self._index)

    def counters(self) -> TierCounters:
        """What it holds and has done; a put dropped for want of a slot counts as a write error."""
        with self._lock:
            bytes_per_block = self.identity.bytes_per_block if self.identity is not None else 0
            return TierCounters(len(self._index), len(self._index) * bytes_per_block, self.capacity_bytes,
                                self._num_bytes_written, self._num_bytes_read, self._num_dropped)

    def close(self) -> None:
        """Nothing to release: RAM goes with the process (the buffer with the last reference)."""
