"""The threads that move blocks between the pool and the disk tier, behind the block manager's back.

- The writer (write-behind): takes committed blocks from the manager's book under the manager's
  lock, copies their bytes there (so a block evicted and reused right after is never written with
  its new content: ``take_tier_writes`` checked it still holds its key), and writes the copies out
  after releasing the lock, copying everything newly committed before each file it writes. A Step
  never waits for a disk.
- The loader: fills the fresh pool blocks of a load (pinned, invisible to every client, so no lock
  is needed for their bytes) from the tier's files, then ends the load under the lock
  (``BlockManager.finish_load``). A missing or bad file ends the load early: what was not loaded is
  recomputed by the client, never an error.

Loading or recomputing (``worth_loading``): a load of ``n`` blocks takes about (the bytes queued
for loading ahead of it + ``n`` blocks' bytes) / the read bandwidth measured on past loads (an
average weighted to the recent ones); recomputing takes ``n * block_size`` tokens / the prefill
speed the client measured and sent with its Step. The load goes ahead when it is the faster; while
either figure is unknown (the first load, a client that sent none) it goes ahead. Both are rough
(the read bandwidth depends on the page cache; the prefill speed on the batch), which is why the
comparison is a plain ratio and not a model: the cases it must catch (a slow disk against a fast
GPU, as sglang issue 26305 saw) differ by far more than the error.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from bisect import bisect_left

import torch

from pagedserve.dtypes import DTYPES
from pagedserve.log import get_logger

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.block_types import TierStats
from memory_service.manager.tier_book import TierLoad
from memory_service.tier.disk_tier import DiskTier

log = get_logger("memory_service.tier")

# Blocks the writer copies per hold of the manager's lock: ~10 us each for a small model's block,
# so a Step waits at most a fraction of a millisecond for it.
WRITE_BATCH_BLOCKS = 4
# Bytes of block copies the writer may hold before writing them (see _write_loop).
STAGING_BYTES = 256 << 20
# How long the writer sleeps when nothing wakes it (a Step wakes it at once).
WRITER_IDLE_S = 0.05
# Weight of the newest load in the read bandwidth's moving average.
BANDWIDTH_EWMA = 0.3
# Upper bounds (seconds) of the load latency histogram's buckets (the last one is +Inf).
LOAD_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TierWorker:
    """The writer and loader threads of one disk tier over one pool and block manager.

    Args:
        disk: the disk tier, already ``open``.
        manager: the block manager; every call to it is made under ``lock``.
        lock: the lock that serialises the manager's calls (the servicer's, or InProcessAllocator's).
        pool: the pool tensor, (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
    """

    def __init__(self, disk: DiskTier, manager: BlockManager, lock: threading.Lock, pool: torch.Tensor) -> None:
        identity = disk.identity
        assert identity is not None, "open the disk tier first"
        self.disk = disk
        self._manager = manager
        self._lock = lock
        self._pool = pool
        self._block_shape = identity.block_shape
        self._dtype = DTYPES[identity.dtype]
        self._bytes_per_block = identity.bytes_per_block
        self._block_size = identity.block_size
        self._read_bytes_per_s: float | None = None  # measured on loads
        self._queued_bytes = 0  # of loads submitted and not finished
        self._latency_counts = [0] * (len(LOAD_LATENCY_BUCKETS_S) + 1)
        self._latency_sum_s = 0.0
        self._stats_lock = threading.Lock()
        self._stopping = threading.Event()
        self._wake_writer = threading.Event()
        self._loads: queue.SimpleQueue[TierLoad | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)
        self._writer.start()
        self._loader.start()

    # --- what the manager asks (TierDirectory), under its lock ---------------------------------

    def num_leading(self, keys: list[bytes]) -> int:
        return self.disk.num_leading(keys)

    def worth_loading(self, num_blocks: int, prefill_tokens_per_s: float) -> bool:
        """Whether loading ``num_blocks`` blocks is estimated faster than recomputing them (module
        docstring); True while either speed is unknown."""
        bandwidth = self._read_bytes_per_s
        if bandwidth is None or prefill_tokens_per_s <= 0:
            return True
        load_s = (self._queued_bytes + num_blocks * self._bytes_per_block) / bandwidth
        recompute_s = num_blocks * self._block_size / prefill_tokens_per_s
        return load_s < recompute_s

    # --- what the owner calls after each step -------------------------------------------------

    def submit(self, loads: list[TierLoad]) -> None:
        """Queues the step's new loads and wakes the writer (the step may have committed blocks)."""
        for load in loads:
            with self._stats_lock:
                self._queued_bytes += len(load.block_ids) * self._bytes_per_block
            self._loads.put(load)
        self._wake_writer.set()

    def stats(self) -> TierStats:
        """The disk tier's counters with the manager's hits and misses (call under the manager's lock)."""
        c = self.disk.counters()
        hits, misses, loads, skipped = self._manager.tier_counters()
        return TierStats("disk", c.num_blocks, c.num_bytes, c.capacity_bytes, hits, misses, c.num_bytes_written,
                         c.num_bytes_read, c.num_write_errors, c.num_bad_files, loads, skipped)

    def load_latency(self) -> tuple[list[tuple[float, int]], float]:
        """The load latency histogram: cumulative ``(upper bound s, count)`` buckets (+Inf last), and
        the sum of the latencies in seconds."""
        with self._stats_lock:
            counts, total = list(self._latency_counts), self._latency_sum_s
        buckets, cumulative = [], 0
        for bound, count in zip((*LOAD_LATENCY_BUCKETS_S, float("inf")), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        return buckets, total

    def close(self) -> None:
        """Stops both threads (a load in progress ends first; queued ones are dropped)."""
        self._stopping.set()
        self._wake_writer.set()
        self._loads.put(None)
        self._writer.join()
        self._loader.join()

    # --- the threads --------------------------------------------------------------------------

    def _write_loop(self) -> None:
        # Copies first, writes after: a copy (a memcpy under the lock) is what saves a block from
        # eviction, a write (checksum, file) takes far longer. So whatever is committed is copied into
        # ``staged`` before the next file is written, up to STAGING_BYTES; a small pool that evicts a
        # prompt's blocks one request later still has them on their way to the disk.
        staged: collections.deque[tuple[bytes, bytes, torch.Tensor]] = collections.deque()
        while not self._stopping.is_set():
            if not staged:
                self._wake_writer.wait(WRITER_IDLE_S)
                self._wake_writer.clear()
            while len(staged) * self._bytes_per_block < STAGING_BYTES and not self._stopping.is_set():
                with self._lock:
                    taken = self._manager.take_tier_writes(WRITE_BATCH_BLOCKS)
                    for block_id, key, ns_key in taken:
                        if key not in self.disk:
                            block = torch.empty(self._block_shape, dtype=self._dtype)
                            block.copy_(self._pool[:, :, block_id])
                            staged.append((key, ns_key, block))
                if not taken:
                    break
            if staged and not self._stopping.is_set():
                key, ns_key, block = staged.popleft()
                # (num_layers, 2, block_size, num_kv_heads, head_dim) -> its bytes, as the pool holds them
                self.disk.put(key, ns_key, memoryview(block.view(torch.uint8).numpy()).cast("B"))

    def _load_loop(self) -> None:
        while True:
            load = self._loads.get()
            if load is None or self._stopping.is_set():
                return
            start = time.monotonic()
            num_loaded = 0
            try:
                for key, block_id in zip(load.hashes, load.block_ids):
                    payload = self.disk.get(key, load.ns_key)
                    if payload is None:
                        break
                    block = torch.frombuffer(payload, dtype=torch.uint8).view(self._dtype).view(self._block_shape)
                    self._pool[:, :, block_id].copy_(block)
                    num_loaded += 1
                if self._pool.is_cuda:  # the bytes are on the device before any client may read them
                    torch.cuda.synchronize(self._pool.device)
            except Exception as exc:  # a failed load is recomputed, never an error (logged here)
                log.error("kv_tier_load_failed", seq_id=load.seq_id, num_loaded=num_loaded,
                          error=type(exc).__name__, exc_info=exc)
            elapsed_s = time.monotonic() - start
            with self._lock:
                self._manager.finish_load(load, num_loaded)
            self._record(load, num_loaded, elapsed_s)

    def _record(self, load: TierLoad, num_loaded: int, elapsed_s: float) -> None:
        with self._stats_lock:
            self._queued_bytes -= len(load.block_ids) * self._bytes_per_block
            self._latency_counts[bisect_left(LOAD_LATENCY_BUCKETS_S, elapsed_s)] += 1
            self._latency_sum_s += elapsed_s
            if num_loaded and elapsed_s > 0:
                bandwidth = num_loaded * self._bytes_per_block / elapsed_s
                old = self._read_bytes_per_s
                self._read_bytes_per_s = bandwidth if old is None else old + BANDWIDTH_EWMA * (bandwidth - old)
        log.info("kv_tier_loaded", seq_id=load.seq_id, num_blocks=len(load.block_ids), num_loaded=num_loaded,
                 elapsed_s=round(elapsed_s, 4))
