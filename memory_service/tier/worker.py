"""The threads that move blocks between the pool and the tiers below it, behind the block manager's back.

The tiers, fastest first, each reached only through ``tier.py``'s Protocols: the memory tiers (the
host tier, ``host_tier.py``, RAM) in front of the IO tiers (the disk tier, ``disk_tier.py``, files);
either or both, or another of either kind. Inclusive, written through (below, "the host tier" stands
for the memory tiers and "the disk" for the IO tiers):

- The writer (write-behind): takes committed blocks from the manager's book (under the manager's
  lock: bookkeeping only) and copies each out of the pool without the lock, into a page-aligned
  staging buffer that it later writes to a file as it is (``DiskTier.put_buffer``), and from there
  into the host tier's buffer (a memcpy: that is the whole host write); it copies everything newly
  committed before each file it writes. Committed bytes never change until the block is handed out
  again, which bumps its generation (``BlockPool.generations``): a copy whose block changed
  generation meanwhile is dropped (``is_unchanged``, under the lock), so a block evicted and reused
  during its copy is never written with its new content. Why not copy under the lock, as before: the
  writer runs at the lowest priority, and a writer descheduled in the middle of a copy held every
  client's Step until it ran again (the no-reuse benchmark's cost: docs/benchmarks.md). A Step never
  waits for a disk, nor does the host tier: with the staging buffers full, blocks go into RAM and
  reach the disk from there. Why write
  through rather than let the host tier evict to the disk: every block reaches the disk as soon as
  it would have without the host tier, so a restart (which empties the RAM) finds what it found
  before; the disk writes cost the same as without a host tier, and a host eviction is a plain drop.
  A clean stop (``close``: SIGTERM) first writes what is committed and not on disk yet, staged or
  not, for at most ``CLOSE_WRITE_S`` (a line says what a cut-short stop left): those are the
  newest blocks, the ones a restart is most likely asked for. A crash loses them (the cache only).
- The loaders (``LOADERS`` threads, a load each): fill the fresh pool blocks of a load (pinned,
  invisible to every client, so no lock is needed for their bytes), each from the fastest tier that
  holds it: the host tier (a copy from its slot, ``non_blocking`` on CUDA), else the disk tier's
  file, which is then also put in the host tier (the next eviction of that prefix is found in RAM).
  Then it ends the load under the lock (``BlockManager.finish_load``). A block no tier has (or a
  bad file) ends the load early: what was not loaded is recomputed by the client, never an error;
  so does a file read still out at the load's deadline (``LOAD_DEADLINE_S``).

Loading or recomputing (``worth_loading``), and what is counted (``stats``): ``accounts.py``. Host
loads are asynchronous too (the same ``loading`` contract): a memcpy of a long prompt's blocks (~180
MB for 4,000 tokens of the default model in float32, ~0.5 GB for an 8B model in bf16) inside the Step
would hold every client's Step for its duration.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import mmap
import os
import queue
import threading
import time

import torch

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.dtypes import DTYPES
from pagedserve.log import get_logger

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.block_types import TierStats
from memory_service.manager.chain import BlockOrigin
from memory_service.manager.tier_book import TierLoad
from memory_service.tier.accounts import TierAccounts
from memory_service.tier.tier import IoTier, MemoryTier

log = get_logger("memory_service.tier")

# Blocks the writer takes from the manager's book per hold of its lock (bookkeeping only: it copies
# them without the lock, then checks their generations under it again): a few, so that a Step never
# waits long for that lock.
WRITE_BATCH_BLOCKS = 4
# Bytes of block copies the writer may hold before writing them (see _write_loop).
STAGING_BYTES = 256 << 20
# Staging buffers kept for reuse once written (~24 MB of the default model's bf16 blocks); a burst's
# others are unmapped, so the service's memory falls back after it.
KEPT_BUFFERS = 64
# Block files a load reads ahead, in parallel (file reads release the GIL): the files are written
# past the page cache, so a load reads them from the device, where one read at a time left most of
# its bandwidth unused (docs/benchmarks.md, "Figures behind the code's choices").
READ_AHEAD_FILES = 8
# Loader threads: loads run side by side, so one slow disk load (a long prompt, a stalled device) never
# holds another prompt's load, nor a host-tier load (a memcpy) behind it.
LOADERS = 2
# A load's deadline: ``LOAD_DEADLINE_S`` plus its bytes at ``LOAD_DEADLINE_BYTES_PER_S``,
# a bandwidth far below any device's (what real loads take: docs/benchmarks.md). A file read that has
# not come back by then ends the load: what was loaded stays, the rest is recomputed by the client (a
# miss, never an error). The read itself cannot be interrupted: its reader thread stays in it (one of
# ``READ_AHEAD_FILES``).
LOAD_DEADLINE_S = 5.0
LOAD_DEADLINE_BYTES_PER_S = 50e6
# How long the writer sleeps when nothing wakes it (a Step wakes it at once).
WRITER_IDLE_S = 0.05
# The writer thread runs at SCHED_IDLE (Linux: per thread; where that is refused, at this nice value).
# Its work (copies, checksums, file writes) is never urgent, and on a machine whose cores the engine's
# threads fill, every wake-up of a writer at the engine's priority descheduled one of them and held its
# whole parallel region; nice 19 still takes a share of each busy core, SCHED_IDLE only the time the
# engine leaves (between steps, while a Step is answered). So under saturation the writer writes part
# of the blocks and the rest are evicted before it reaches them (``num_blocks_missed``); below
# saturation it keeps up. The risk it carries: the writer holds the manager's lock for bookkeeping and
# the GIL between the calls that release it, and a Step handler needing either waits until the writer
# runs again. With one engine that is at once (the engine waits on that Step, which frees a core); with
# several engines on the node, or other busy processes, a descheduled writer may wait for a free core
# while the others run (at nice 19 too, for a short slice). The way out is a writer in a process of its
# own (no GIL shared with the Step handlers), not done. The no-reuse benchmark's figures at each
# priority: docs/benchmarks.md ("Figures behind the code's choices").
WRITER_NICE = 19
# The most a clean stop waits for the writer to put what is committed on disk (module docstring);
# well within the 10 s a ServiceProcess (and ``pagedserve up``) gives a service after SIGTERM.
CLOSE_WRITE_S = 2.0


class TierWorker:
    """The writer and loader threads of the tiers below one pool and block manager.

    Args:
        manager: the block manager; every call to it is made under ``lock``.
        lock: the lock that serialises the manager's calls (the servicer's, or InProcessAllocator's).
        pool: the pool tensor, (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
        tiers: the tiers, already ``open``, fastest first: the memory tiers, then the IO tiers
            (``tier.py``); at least one, each of its own ``kind``, all of one identity.
    """

    def __init__(self, manager: BlockManager, lock: threading.Lock, pool: torch.Tensor,
                 tiers: Sequence[MemoryTier | IoTier]) -> None:
        assert tiers and all(t.identity is not None for t in tiers), "open the tiers first"
        identity = tiers[0].identity
        assert all(t.identity == identity for t in tiers), "the tiers keep one model and layout"
        assert len({t.kind for t in tiers}) == len(tiers), "one tier of each kind"
        is_memory = [isinstance(t, MemoryTier) for t in tiers]
        assert all(is_memory[i] or isinstance(t, IoTier) for i, t in enumerate(tiers)), "a tier of neither kind"
        assert is_memory == sorted(is_memory, reverse=True), "the memory tiers come first (fastest first)"
        self.tiers: dict[str, MemoryTier | IoTier] = {t.kind: t for t in tiers}  # fastest first
        self._memory: list[MemoryTier] = [t for t, m in zip(tiers, is_memory) if m]
        self._io: list[IoTier] = [t for t, m in zip(tiers, is_memory) if not m]
        self._manager = manager
        self._lock = lock
        self._pool = pool
        self._block_shape = identity.block_shape
        self._dtype = DTYPES[identity.dtype]
        self._bytes_per_block = identity.bytes_per_block
        self.accounts = TierAccounts(list(self.tiers), identity.bytes_per_block, identity.block_size, self._tier_of)
        # Per IO tier: committed blocks the memory tiers evicted before their write (or that had no slot there).
        self._num_missed = dict.fromkeys((t.kind for t in self._io), 0)
        # Per IO tier: its staging buffers written out, for the next copies.
        self._free_buffers: dict[str, list[mmap.mmap]] = {t.kind: [] for t in self._io}
        # Where a block goes that only the memory tiers take (its copy is checked before it is put there).
        self._scratch = [torch.empty(self._block_shape, dtype=self._dtype) for _ in range(WRITE_BATCH_BLOCKS)]
        self._stopping = threading.Event()
        self._close_deadline = 0.0  # set by ``close`` before ``_stopping``
        self._wake_writer = threading.Event()
        self._loads: queue.SimpleQueue[TierLoad | None] = queue.SimpleQueue()
        # Called on the loader thread after each load (its start, blocks loaded, blocks read per tier):
        # the service's trace spans (memory_service/service/step_traces.py), when on.
        self.on_load_done: Callable[[TierLoad, float, int, dict[str, int]], None] | None = None
        self._readers = (ThreadPoolExecutor(READ_AHEAD_FILES, thread_name_prefix="kv-tier-read")
                         if self._io else None)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._loaders = [threading.Thread(target=self._load_loop, name=f"kv-tier-loader-{i}", daemon=True)
                         for i in range(LOADERS)]
        self._writer.start()
        for loader in self._loaders:
            loader.start()

    # --- what the manager asks (TierDirectory), under its lock ---------------------------------

    def _tier_of(self, key: bytes) -> str | None:
        """The fastest tier that holds ``key`` (dict lookups: no IO)."""
        for kind, tier in self.tiers.items():
            if key in tier:
                return kind
        return None

    def num_leading(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, some tier holds."""
        num = 0
        for key in keys:
            if self._tier_of(key) is None:
                break
            num += 1
        return num

    def count_lookup(self, keys: list[bytes], num_found: int, is_skipped: bool) -> None:
        """Counts an allocation's lookup past the pool's prefix, per tier (``TierAccounts.count_lookup``)."""
        self.accounts.count_lookup(keys, num_found, is_skipped)

    def worth_loading(self, keys: list[bytes], prefill_tokens_per_s: float) -> bool:
        """Whether loading the blocks ``keys`` beats recomputing them (``TierAccounts.worth_loading``)."""
        return self.accounts.worth_loading(keys, prefill_tokens_per_s)

    def needs_write(self, key: bytes) -> bool:
        """Whether an IO tier lacks ``key``: a block loaded from RAM whose write was missed or failed,
        or whose file went (without it, a restart would not find that prefix). A block loaded from an
        IO tier went into RAM on its way (``_load_loop``)."""
        return any(key not in t for t in self._io)

    # --- what the owner calls after each step -------------------------------------------------

    def submit(self, loads: list[TierLoad]) -> None:
        """Queues the step's new loads and wakes the writer (the step may have committed blocks)."""
        for load in loads:
            self.accounts.add_load(load)
            self._loads.put(load)
        self._wake_writer.set()

    def stats(self) -> tuple[TierStats, ...]:
        """Each tier's counters, fastest first (``accounts.py`` says what the lookups count)."""
        counts = self.accounts.counts()
        num_missed = self._manager.num_tier_writes_missed  # an int read: no lock needed
        stats = []
        for kind, tier in self.tiers.items():
            c, n = tier.counters(), counts[kind]
            stats.append(TierStats(kind, c.num_blocks, c.num_bytes, c.capacity_bytes, n.num_hits, n.num_misses,
                                   c.num_bytes_written, c.num_bytes_read, c.num_write_errors, c.num_bad_files,
                                   n.num_loads, n.num_loads_skipped, num_missed + self._num_missed.get(kind, 0)))
        return tuple(stats)

    def load_latency(self) -> dict[str, tuple[list[tuple[float, int]], float]]:
        """Per tier, the load latency histogram (``TierAccounts.load_latency``)."""
        return self.accounts.load_latency()

    def close(self) -> None:
        """Stops both threads. The writer first writes the committed blocks that are not in the IO
        tiers yet, for at most ``CLOSE_WRITE_S`` (module docstring); a load in progress ends first,
        queued ones are dropped. Then each tier's ``close``."""
        self._close_deadline = time.monotonic() + CLOSE_WRITE_S
        # Back at the normal policy from here: a writer at SCHED_IDLE on cores that other threads fill
        # would not run at all before the deadline, not even to raise its own priority.
        if self._writer.native_id is not None:
            _set_writer_policy(idle=False, tid=self._writer.native_id)
        self._stopping.set()
        self._wake_writer.set()
        for _ in self._loaders:
            self._loads.put(None)
        self._writer.join()
        for loader in self._loaders:
            loader.join()
        if self._readers is not None:
            self._readers.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers.values():
            tier.close()  # the disk's directory lock: another service may take it now

    # --- the threads --------------------------------------------------------------------------

    def _write_loop(self) -> None:
        # Copies first, writes after: a copy is what saves a block from eviction, a write (checksum,
        # file) takes far longer. So whatever is committed is copied (into ``staged`` for the IO tiers,
        # and into the memory tiers) before the next buffer is written, up to STAGING_BYTES of staged
        # copies; a small pool that evicts a prompt's blocks one request later still has them on their
        # way to the disk. With a memory tier, a full staging does not stop the copies into RAM: the
        # blocks past it are written to the IO tiers later from their memory slots (``deferred``, at
        # most as many as the memory tiers hold), so a disk slower than the commits never holds the
        # host tier back.
        _set_writer_policy(idle=True)
        staged: collections.deque[tuple[IoTier, bytes, bytes, mmap.mmap, BlockOrigin]] = collections.deque()
        deferred: collections.deque[tuple[IoTier, bytes, bytes, BlockOrigin]] = collections.deque(
            maxlen=max(1, sum(t.num_slots for t in self._memory) * len(self._io)))
        while not self._stopping.is_set():
            if not staged and not deferred:
                self._wake_writer.wait(WRITER_IDLE_S)
                self._wake_writer.clear()
            self._copy_committed(staged, deferred)
            if self._stopping.is_set():
                break
            if staged:
                self._write_staged(*staged.popleft())
            elif deferred:
                self._write_from_memory(*deferred.popleft())
        self._finish_writes(staged, deferred)

    def _finish_writes(self, staged: collections.deque, deferred: collections.deque) -> None:
        """At close: writes the committed blocks not in the IO tiers yet (staged, deferred, or still in
        the book) until none is left or ``CLOSE_WRITE_S`` is up, whichever comes first."""
        if not self._io:  # RAM does not outlive the process
            return
        _set_writer_policy(idle=False)  # the engine is stopping: these writes are all that is left
        num_written = 0
        while time.monotonic() < self._close_deadline:
            self._copy_committed(staged, deferred)
            if staged:
                self._write_staged(*staged.popleft())
            elif deferred:
                self._write_from_memory(*deferred.popleft())
            else:
                break
            num_written += 1
        num_left = len(staged) + len(deferred)
        if num_left:  # the blocks still in the book are not counted: at least this many
            log.warning("kv_tier_close_cut_short", num_blocks_written=num_written, num_blocks_left=num_left,
                        limit_s=CLOSE_WRITE_S, action="the blocks left are not on disk: a restart recomputes them")
        elif num_written:
            log.info("kv_tier_writes_finished_at_close", num_blocks=num_written)

    def _copy_committed(self, staged: collections.deque, deferred: collections.deque) -> None:
        """Copies the blocks committed since the last call into ``staged`` while it has room, and into
        the memory tiers (``_write_loop``); the IO tiers' others go to ``deferred`` with a memory tier,
        else wait in the book."""
        while True:  # at close too (``_finish_writes``): what is committed is copied before the pool goes
            num_room = STAGING_BYTES // self._bytes_per_block - len(staged)
            # Without a memory tier a block past the staging's room would have nowhere to go: it waits in
            # the book (where an eviction may still take it: counted missed, not lost unseen).
            num_wanted = WRITE_BATCH_BLOCKS if self._memory else min(WRITE_BATCH_BLOCKS, num_room)
            if num_wanted <= 0:
                return
            with self._lock:
                taken = self._manager.take_tier_writes(num_wanted)
            if not taken:
                return
            # Per block: its key, namespace, the IO tiers lacking it, each one's staging buffer (None: no
            # room, or a later IO tier's), and the one copy out of the pool (None: in every tier).
            copies: list[tuple[bytes, bytes, list[IoTier], list[mmap.mmap | None], torch.Tensor | None]] = []
            num_buffers = 0
            for block_id, key, ns_key, _, _ in taken:  # no lock: the generations say which copies hold
                to_io = [t for t in self._io if key not in t]
                if not to_io and all(key in t for t in self._memory):
                    copies.append((key, ns_key, [], [], None))  # in every tier: made young below
                    continue
                buffers: list[mmap.mmap | None] = []
                for tier in to_io:
                    has_room = num_buffers < num_room
                    buffers.append(self._staging_buffer(tier) if has_room else None)
                    num_buffers += has_room
                target = (self._payload(to_io[0], buffers[0]) if buffers and buffers[0] is not None
                          else self._scratch[len(copies)])
                copies.append((key, ns_key, to_io, buffers, target.copy_(self._pool[:, :, block_id])))
            with self._lock:
                unchanged = [self._manager.is_unchanged(block_id, generation)
                             for block_id, _, _, generation, _ in taken]
            for (key, ns_key, to_io, buffers, block), is_unchanged, (*_, origin) in zip(copies, unchanged, taken):
                if not is_unchanged:
                    for tier, buffer in zip(to_io, buffers):
                        if buffer is not None:
                            self._recycle(tier, buffer)
                    continue
                if block is None:
                    for tier in self._memory:
                        tier.touch(key)
                    continue
                is_in_memory = False
                for tier in self._memory:
                    is_in_memory = tier.put(key, ns_key, block) or is_in_memory
                for i, (tier, buffer) in enumerate(zip(to_io, buffers)):
                    if buffer is not None:
                        if i > 0:  # the copy is in the first IO tier's buffer: this one gets its own
                            self._payload(tier, buffer).copy_(block)
                        staged.append((tier, key, ns_key, buffer, origin))
                        continue
                    if not is_in_memory or len(deferred) == deferred.maxlen:
                        self._num_missed[tier.kind] += 1  # no slot in RAM to wait in, or the oldest waiting goes
                    if is_in_memory:
                        deferred.append((tier, key, ns_key, origin))

    def _staging_buffer(self, tier: IoTier) -> mmap.mmap:
        """A buffer of ``tier`` (``IoTier.new_buffer``: page-aligned for the disk), reused once written."""
        free = self._free_buffers[tier.kind]
        return free.pop() if free else tier.new_buffer()

    def _payload(self, tier: IoTier, buffer: mmap.mmap) -> torch.Tensor:
        """The block-shaped view of a staging buffer's payload."""
        return torch.frombuffer(buffer, dtype=torch.uint8, count=self._bytes_per_block,
                                offset=tier.identity.payload_offset).view(self._dtype).view(self._block_shape)

    def _get(self, key: bytes, ns_key: bytes) -> tuple[str, memoryview] | None:
        """The block ``key`` from the first IO tier that gives it (on a reader thread): its kind and bytes."""
        for tier in self._io:
            payload = tier.get(key, ns_key)
            if payload is not None:
                return tier.kind, payload
        return None

    def _read_ahead(self, keys: list[bytes], ns_key: bytes,
                    deadline: float) -> Iterator[tuple[str, memoryview] | None]:
        """The IO tiers' payloads of ``keys`` in order (``_get``; None: missing or bad, or not read by
        ``deadline``, a ``time.monotonic()``), up to ``READ_AHEAD_FILES`` of them read in parallel
        ahead of the one asked for. Files read ahead of a gap that ends the load were read all the
        same: the tier counts their bytes and makes them recently used."""
        if self._readers is None:
            yield from itertools.repeat(None, len(keys))
            return
        remaining = iter(keys)
        pending: collections.deque[Future] = collections.deque(
            self._readers.submit(self._get, key, ns_key) for key in itertools.islice(remaining, READ_AHEAD_FILES))
        try:
            while pending:
                try:
                    payload = pending.popleft().result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    log.warning("kv_tier_load_deadline", num_left=len(pending) + 1,
                                deadline_s=round(deadline - time.monotonic(), 3), action="the rest is recomputed")
                    payload = None
                key = next(remaining, None)
                if key is not None:
                    pending.append(self._readers.submit(self._get, key, ns_key))
                yield payload
        finally:
            for future in pending:
                future.cancel()

    def _recycle(self, tier: IoTier, buffer: mmap.mmap) -> None:
        free = self._free_buffers[tier.kind]
        if len(free) < KEPT_BUFFERS:
            free.append(buffer)  # (the others are unmapped when the last reference goes)

    def _write_staged(self, tier: IoTier, key: bytes, ns_key: bytes, buffer: mmap.mmap, origin: BlockOrigin) -> None:
        try:
            tier.put_buffer(key, ns_key, buffer, origin)
        finally:
            self._recycle(tier, buffer)

    def _write_from_memory(self, tier: IoTier, key: bytes, ns_key: bytes, origin: BlockOrigin) -> None:
        """Writes a deferred block to an IO tier from a memory tier's slot, if one still holds it
        (pinned meanwhile: no put reuses the slot under the write)."""
        if key in tier:
            return
        for memory in self._memory:
            held = memory.acquire(key, ns_key, make_young=False)
            if held is not None:
                break
        else:  # evicted from RAM before its turn: not written, as a block evicted from the pool
            self._num_missed[tier.kind] += 1
            return
        slot, view = held
        try:
            tier.put(key, ns_key, memoryview(view.view(torch.uint8).numpy()).cast("B"), origin)
        finally:
            memory.release(slot, is_read=False)

    def _acquire(self, key: bytes, ns_key: bytes) -> tuple[MemoryTier, int, torch.Tensor] | None:
        """``key`` pinned in the fastest memory tier that holds it: the tier, its slot and view."""
        for tier in self._memory:
            held = tier.acquire(key, ns_key)
            if held is not None:
                return tier, *held
        return None

    def _load_loop(self) -> None:
        while True:
            load = self._loads.get()
            if load is None or self._stopping.is_set():
                return
            start = time.monotonic()
            deadline = start + LOAD_DEADLINE_S + len(load.hashes) * self._bytes_per_block / LOAD_DEADLINE_BYTES_PER_S
            read_s = dict.fromkeys(self.accounts.kinds, 0.0)
            num_read = dict.fromkeys(read_s, 0)
            num_loaded = 0
            # The memory tiers' blocks of this load pinned first: an IO block put in a memory tier on
            # its way (below) then never evicts a block this same load is about to copy from there.
            held = [self._acquire(key, load.ns_key) for key in load.hashes]
            is_read = [False] * len(held)  # per held slot: copied from (it stops at a block no tier has)
            files = self._read_ahead([key for key, tier_slot_view in zip(load.hashes, held) if tier_slot_view is None],
                                     load.ns_key, deadline)
            try:
                for i, (key, block_id, tier_slot_view) in enumerate(zip(load.hashes, load.block_ids, held)):
                    target = self._pool[:, :, block_id]
                    t0 = time.monotonic()
                    if tier_slot_view is not None:
                        tier, _, view = tier_slot_view
                        target.copy_(view, non_blocking=True)  # from page-locked memory on CUDA
                        is_read[i] = True
                        read_s[tier.kind] += time.monotonic() - t0
                        num_read[tier.kind] += 1
                    else:
                        kind_payload = next(files)
                        if kind_payload is None:
                            break
                        kind, payload = kind_payload
                        block = torch.frombuffer(payload, dtype=torch.uint8).view(self._dtype).view(self._block_shape)
                        target.copy_(block)
                        read_s[kind] += time.monotonic() - t0
                        num_read[kind] += 1
                        for memory in self._memory:
                            memory.put(key, load.ns_key, block)
                    num_loaded += 1
                if self._pool.is_cuda:  # the bytes are on the device before any client may read them
                    t0 = time.monotonic()
                    torch.cuda.synchronize(self._pool.device)
                    for memory in self._memory:  # the wait for their non_blocking copies
                        if num_read[memory.kind]:
                            read_s[memory.kind] += time.monotonic() - t0
            except Exception as exc:  # a failed load is recomputed, never an error (logged here)
                log.error("kv_tier_load_failed", seq_id=load.seq_id, num_loaded=num_loaded,
                          error=type(exc).__name__, exc_info=exc)
                if self._pool.is_cuda:  # copies issued may not have landed: trust none of them
                    num_loaded = 0
                    with contextlib.suppress(Exception):  # before the slots they read are released
                        torch.cuda.synchronize(self._pool.device)
            finally:
                files.close()  # the reads ahead not needed (past a block no tier has) are cancelled
                for tier_slot_view, was_read in zip(held, is_read):  # after the synchronisation: no copy reads them
                    if tier_slot_view is not None:
                        tier_slot_view[0].release(tier_slot_view[1], was_read)
            elapsed_s = time.monotonic() - start
            with self._lock:
                self._manager.finish_load(load, num_loaded)
            self.accounts.record(load, num_read, read_s, elapsed_s)
            if self.on_load_done is not None:
                self.on_load_done(load, start, num_loaded, num_read)
            log.info("kv_tier_loaded", seq_id=load.seq_id, num_blocks=len(load.block_ids), num_loaded=num_loaded,
                     **{f"num_{kind}_blocks": n for kind, n in num_read.items()}, elapsed_s=round(elapsed_s, 4))


def _set_writer_policy(*, idle: bool, tid: int | None = None) -> None:
    """The thread ``tid`` (default: the calling one) at SCHED_IDLE (``idle``; ``WRITER_NICE``'s comment
    says why), else at nice ``WRITER_NICE`` where that is refused; or back at the normal policy (a clean
    stop's last writes: unprivileged, Linux may keep it idle, which only slows those). Not Linux, or
    not permitted: as it is."""
    tid = threading.get_native_id() if tid is None else tid
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
        return
    except (OSError, AttributeError):
        pass
    if idle:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
