"""One step's token masks for the constrained sequences of a batch, filled off the engine thread.

Per step, each constrained sequence gets one bitmask row (bit j = token j allowed), then the rows
are applied to a copy of the logits: the raw logits stay untouched when a sequence asks for
logprobs (the log-softmax of the model's raw logits), else the rows (already the engine's own
copy) are masked in place. A batch without a constrained sequence skips all of it. Rows of
unconstrained sequences are neither filled nor applied (``indices``).

Why the rows are filled by worker threads, with a deadline: a grammar's fill cost can grow with
every token it accepts (``(.{0,60}){0,60}x`` goes from 0.3 ms to seconds within 30 tokens, and a
49k vocabulary makes it minutes), and a fill in C++ cannot be interrupted. On the engine thread
one such fill would stall every request of every tenant. So each constrained row is one job for a
small pool (xgrammar releases the GIL while it fills); the engine waits for the step's jobs until
``timeout_s``. A job still running then is *late*: its request alone fails (``MaskFillTimeout``)
and the step goes on without it. A fill that returns in time but took more than ``max_fill_cpu_s``
of CPU (measured in its worker: a loaded machine does not inflate it) fails its request too, so
that a mask whose cost grows with every token stops the step a few times briefly rather than
until it reaches the deadline. Its thread is abandoned (it finishes in the background and
exits) and a fresh one takes its place, so the pool keeps its size; a late job writes into a
bitmask buffer that is never reused (the masker allocates a new one). Rows are separate jobs
rather than one batched fill so that a late fill names exactly one request, and no abandoned
fill can still be touching another request's matcher.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

DEFAULT_FILL_TIMEOUT_S = 1.0
DEFAULT_MAX_FILL_CPU_S = 0.1  # ordinary fills take well under a millisecond, even for 49k tokens
_IDLE_EXIT_S = 60.0  # an idle worker exits after this long (engines are rebuilt on re-attach)

_abandoned_lock = threading.Lock()
_num_abandoned = 0  # late fills still running, process-wide (see num_abandoned_fills)


def num_abandoned_fills() -> int:
    """Late mask fills still running in C++ in this process: while any is, interpreter
    finalization would destroy the grammar engine under it, so a service exits with ``os._exit``."""
    return _num_abandoned


class MaskFillTimeout(RuntimeError):
    """A sequence's mask was not filled within the deadline: its grammar is too costly."""


@dataclass(eq=False)
class _FillJob:
    matcher: xgr.GrammarMatcher
    bitmask: torch.Tensor  # the step's whole (rows, words) buffer; this job writes row ``row``
    row: int
    state: str = "queued"  # queued -> running -> done, or running -> late (abandoned)
    error: Exception | None = None
    cpu_s: float = 0.0  # the fill's CPU time in its worker


@dataclass
class MaskedLogits:
    """``apply``'s result.

    Attributes:
        logits: (B, V) the masked logits (see ``LogitsMasker.apply``).
        failures: rows whose mask could not be filled, with why (``MaskFillTimeout`` when it was
            late); their logits row is unmasked and must not be sampled for their sequence.
    """

    logits: torch.Tensor
    failures: dict[int, Exception] = field(default_factory=dict)


class MaskFillPool:
    """Worker threads that fill bitmask rows, each job within a deadline (see the module docstring).

    Args:
        num_threads: workers kept (one more is started for each abandoned one).
    """

    def __init__(self, num_threads: int = 2) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self._lock = threading.Lock()
        self._has_jobs = threading.Condition(self._lock)  # workers wait on it
        self._all_done = threading.Condition(self._lock)  # the engine waits on it
        self._queue: collections.deque[_FillJob] = collections.deque()
        self._num_pending = 0  # jobs of the current ``fill`` neither done nor late
        self._num_workers = 0  # live, not abandoned
        self.num_late = 0  # jobs that missed their deadline (their requests failed)

    def fill(self, jobs: Sequence[_FillJob], timeout_s: float) -> None:
        """Run the jobs; on return each is ``done`` (with or without ``error``) or ``late``.

        A job still queued when every worker is stuck in a late fill is not late itself: it waits
        for the replacement workers, with a fresh deadline.
        """
        with self._lock:
            self._queue.extend(jobs)
            self._num_pending = len(jobs)
            self._start_workers()
            self._has_jobs.notify(len(jobs))
            while self._num_pending:
                deadline = time.monotonic() + timeout_s
                while self._num_pending and (remaining := deadline - time.monotonic()) > 0:
                    self._all_done.wait(remaining)
                running = [job for job in jobs if job.state == "running"]
                for job in running:
                    job.state = "late"  # its worker sees it when the fill returns, and exits
                    self._num_pending -= 1
                    self._num_workers -= 1
                    self.num_late += 1
                if running:
                    _count_abandoned(len(running))
                    self._start_workers()
                    self._has_jobs.notify(self.num_threads)

    def _start_workers(self) -> None:  # under the lock
        while self._num_workers < self.num_threads:
            self._num_workers += 1
            threading.Thread(target=self._work, name="mask-fill", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    if not self._has_jobs.wait(_IDLE_EXIT_S) and not self._queue:
                        self._num_workers -= 1
                        return
                job = self._queue.popleft()
                job.state = "running"
            error: Exception | None = None
            start = time.thread_time()
            try:
                job.matcher.fill_next_token_bitmask(job.bitmask, job.row)
            except Exception as exc:  # the request's error, reported by the engine
                error = exc
            job.cpu_s = time.thread_time() - start
            with self._lock:
                if job.state == "late":  # the engine went on without it; a new worker replaced this one
                    _count_abandoned(-1)
                    return
                job.state, job.error = "done", error
                self._num_pending -= 1
                if not self._num_pending:
                    self._all_done.notify()


def _count_abandoned(delta: int) -> None:
    global _num_abandoned
    with _abandoned_lock:
        _num_abandoned += delta


class LogitsMasker:
    """Bitmask buffer and fill pool of one engine (``apply`` from the engine thread only).

    Args:
        vocab_size: width of the logits (the model's vocabulary).
        timeout_s: how long one step waits for a row's mask before that row's request fails.
        max_fill_cpu_s: CPU seconds one row's fill may take before its request fails.
        num_threads: fill workers.
    """

    def __init__(self, vocab_size: int, *, timeout_s: float = DEFAULT_FILL_TIMEOUT_S,
                 max_fill_cpu_s: float = DEFAULT_MAX_FILL_CPU_S, num_threads: int = 2) -> None:
        if not timeout_s > 0 or not max_fill_cpu_s > 0:
            raise ValueError(f"timeout_s and max_fill_cpu_s must be > 0, got {timeout_s}, {max_fill_cpu_s}")
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_fill_cpu_s = max_fill_cpu_s
        self.num_failed_fills = 0  # rows whose mask was late or too costly (their requests failed)
        self.pool = MaskFillPool(num_threads)
        self._bitmask = xgr.allocate_token_bitmask(8, vocab_size)  # (rows, ceil(V / 32)) int32, grown on demand
        # What masking has cost so far (benchmarks read them): steps with a constrained row, wall
        # seconds, and the calling thread's CPU seconds (the workers' fills are not in it).
        self.num_masked_steps = 0
        self._copy: torch.Tensor | None = None  # (rows, V) buffer of masked copies, grown on demand
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def apply(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None], *,
              keep_raw: bool = True) -> MaskedLogits:
        """Logits with each constrained row's disallowed tokens at -inf.

        Args:
            logits: (B, V) raw logits, one row per entry of ``matchers``.
            matchers: each row's matcher, None for an unconstrained row. A matcher of a failed row
                may still be in use by an abandoned fill: never pass it again.
            keep_raw: leave ``logits`` untouched (the caller still needs them: logprobs) and mask a
                copy in a buffer kept across steps; False masks ``logits`` in place.
        Returns:
            ``logits`` itself when no row is constrained or ``keep_raw`` is False, else the masked
            copy (B, V), valid until the next call; and the rows whose mask failed.
        """
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return MaskedLogits(logits)
        start, start_cpu = time.perf_counter(), time.thread_time()
        num_rows = len(matchers)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask
        jobs = [_FillJob(matchers[i], bitmask, i) for i in rows]
        self.pool.fill(jobs, self.timeout_s)
        failures: dict[int, Exception] = {}
        for job in jobs:
            if job.state == "late":
                failures[job.row] = MaskFillTimeout(f"the grammar's token mask took longer than {self.timeout_s} s")
            elif job.error is not None:
                failures[job.row] = job.error
            elif job.cpu_s > self.max_fill_cpu_s:
                failures[job.row] = MaskFillTimeout(f"the grammar's token mask took {job.cpu_s:.3f} s of CPU "
                                                    f"(the limit is {self.max_fill_cpu_s} s)")
        self.num_failed_fills += sum(isinstance(e, MaskFillTimeout) for e in failures.values())
        if any(job.state == "late" for job in jobs):
            # A late fill still writes into this buffer: never hand it out again.
            self._bitmask = xgr.allocate_token_bitmask(self._bitmask.shape[0], self.vocab_size)
        rows = [i for i in rows if i not in failures]
        masked = logits
        if keep_raw:
            # A buffer reused across steps: a fresh (32, 49152) float32 copy per step costs more in
            # page faults than filling and applying the masks (docs/benchmarks.md, structured outputs).
            if self._copy is None or self._copy.shape[0] < num_rows or self._copy.shape[1:] != logits.shape[1:] \
                    or self._copy.dtype != logits.dtype or self._copy.device != logits.device:
                self._copy = torch.empty((max(num_rows, 8), *logits.shape[1:]), dtype=logits.dtype,
                                         device=logits.device)
            masked = self._copy[:num_rows]
            masked.copy_(logits)
        if rows:
            xgr.apply_token_bitmask_inplace(masked, bitmask[:num_rows].to(masked.device, non_blocking=True),
                                            vocab_size=self.vocab_size, indices=rows)
        self.num_masked_steps += 1
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - start_cpu
        return MaskedLogits(masked, failures)
