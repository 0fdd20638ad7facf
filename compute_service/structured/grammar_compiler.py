"""Compiling constraints into xgrammar grammars: in worker processes, cached, bounded, shared fairly.

Why processes, not threads: a compile cannot be interrupted (it runs in C++), so a thread past its
timeout kept its worker until the compile ended on its own (minutes, for a schema nested 900
deep), and four such requests starved every tenant's constraints. A worker process past the
timeout is killed and a fresh one started. Each worker also probes the grammar's mask cost before
answering (``compile_worker.probe_masks``): a grammar whose masks are slow is refused here, with
INVALID_ARGUMENT naming the field, instead of slowing the engine's steps. The compiled grammar comes
back serialized and is rebuilt here against the same tokenizer.

The workers start with the first constraint (or ``start()``), not with the compiler: most services
never see a constraint, and each worker costs seconds of CPU to import xgrammar. The first
request's job waits for them to boot (up to ``start_timeout_s``) without that wait counting
against it. The timeout counts from the moment a worker starts the job, not from submission: a
request whose job is still queued behind other compiles a timeout after it asked (or after the
workers became ready) is told the compiler is busy (RESOURCE_EXHAUSTED, retry), and is not blamed
for a cost that is not its own. A job nobody waits
for any more (its requests were cancelled or gave up) is dropped from the queue, and killed if
it runs. Each tenant (``owner``) has its own queue, served round-robin, and may have at most
``max_jobs_per_tenant`` jobs running: one tenant's costly compiles wait behind each other, not in
front of another tenant's.

Verdicts are cached like grammars: invalid text, too costly (killed at the timeout, or slow masks)
are answered at once the next time. Cache key: sha256 of (tokenizer digest, compile options,
kind, text), the text of a JSON schema normalized first (annotations such as ``title`` dropped,
compact; ``pagedserve.grammar_limits.normalized_json_schema``), so variants that differ only there
share a grammar and a verdict. One compiler serves one tokenizer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

from pagedserve import cpu_preload
from pagedserve.errors import InvalidArgument, ResourceExhaustedError
from pagedserve.grammar_limits import normalized_json_schema
from pagedserve.log import get_logger

from compute_service.structured import compile_worker
from compute_service.structured.compile_worker import COMPILE_OPTIONS, ProbeConfig, choice_grammar, engine_message
from compute_service.structured.constraint import Constraint

__all__ = ["GrammarCompiler", "GrammarCompilerConfig", "ProbeConfig", "choice_grammar", "engine_message"]

log = get_logger("grammar_compiler")

_POLL_S = 0.05  # how often a supervisor looks whether anyone still waits for its running job
_BOOT_POLL_S = 0.25  # how often a caller waiting for the workers to start looks at its deadline
# A running compile's wall-time limit: WALL_LIMIT_FACTOR times its CPU limit (timeout_s), at least
# MIN_WALL_LIMIT_S (a short timeout on a loaded machine: a compile's start, a scheduler's slices).
WALL_LIMIT_FACTOR = 8.0
MIN_WALL_LIMIT_S = 10.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# A job's outcome when its worker was killed at the wall-time limit: the request is told to retry.
_STARVED = (None, "starved")


@dataclass(frozen=True)
class GrammarCompilerConfig:
    """Attributes:
        num_threads: compile worker processes (vLLM uses (cpus + 1) // 2 threads).
        timeout_s: the CPU seconds one compile (and its mask probe) may use before it is killed
            and its request refused as too complex (a verdict, cached). CPU, not wall time: the
            workers run at a low priority (``compile_worker.WORKER_NICE``), so on a busy machine a
            compile takes longer without costing more. One still running ``WALL_LIMIT_FACTOR``
            times as long in wall time (and at least ``MIN_WALL_LIMIT_S``: the machine too busy to
            give it the CPU) is killed too, and its request told to retry (RESOURCE_EXHAUSTED, no
            verdict).
        cache_size: compiled grammars (and failures) kept, least recently used dropped first.
        max_jobs_per_tenant: compiles one tenant may have running at once (its others wait).
        probe: how each grammar's mask cost is probed before it is accepted.
        start_timeout_s: how long a worker may take to start (import xgrammar, take the tokenizer),
            and how long the first constraints wait for the workers before they are told to retry.
    """

    num_threads: int = 2
    timeout_s: float = 5.0
    cache_size: int = 256
    max_jobs_per_tenant: int = 1
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")
        if self.max_jobs_per_tenant < 1:
            raise ValueError(f"max_jobs_per_tenant must be >= 1, got {self.max_jobs_per_tenant}")


@dataclass(eq=False)
class _Job:
    constraint: Constraint  # as compiled (a schema normalized)
    key: str
    owner: str | None
    num_waiters: int = 0
    state: str = "queued"  # queued -> running -> done, or queued/running -> dropped (nobody waits)
    started_at: float | None = None  # set by the supervisor
    # (grammar, None) or (None, the reason it is refused): failures are results, not exceptions.
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Worker:
    """One compile worker process and its two pipes (parent side)."""

    def __init__(self) -> None:
        p2c_read, p2c_write = os.pipe()
        c2p_read, c2p_write = os.pipe()
        try:
            # Without the compute process's preload (pagedserve/cpu_preload.py): a worker gains nothing
            # from Intel OpenMP, and one killed with it loaded would leave its file in /dev/shm.
            self.process = subprocess.Popen(
                [sys.executable, compile_worker.__file__, "--parent-pid", str(os.getpid()),
                 "--read-fd", str(p2c_read), "--write-fd", str(c2p_write)],
                pass_fds=(p2c_read, c2p_write), stdin=subprocess.DEVNULL,
                env=cpu_preload.strip_env(dict(os.environ)))
            # Lowered from here, at once: its start (importing xgrammar, seconds of CPU) runs niced too.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.process.pid,
                               min(19, os.getpriority(os.PRIO_PROCESS, 0) + compile_worker.WORKER_NICE))
        finally:
            os.close(p2c_read)
            os.close(c2p_write)
        self.to_worker = Connection(p2c_write, readable=False)
        self.from_worker = Connection(c2p_read, writable=False)

    def start(self, setup: tuple[str, dict], timeout_s: float) -> None:
        """Send the tokenizer and probe settings; return once the worker is ready for jobs."""
        self.to_worker.send(setup)
        if not self.from_worker.poll(timeout_s):
            raise RuntimeError(f"the grammar compile worker did not start within {timeout_s} s")
        self.from_worker.recv()  # ("ready", "")

    def cpu_seconds(self) -> float | None:
        """The CPU time (user + system) the worker has used, from ``/proc``; None where there is none."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        cpu_preload.remove_registration_files(self.process.pid)  # where a preload of its own loaded it
        self.to_worker.close()
        self.from_worker.close()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe. ``close`` stops its worker processes.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        stop_token_ids: every token that ends the model's generation: the grammar allows them only
            where it may end, and the engine stops on them.
        config: workers, timeout, cache size, per-tenant quota, the mask probe.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | tuple[int, ...],
                 config: GrammarCompilerConfig | None = None) -> None:
        self.config = config or GrammarCompilerConfig()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=list(stop_token_ids))
        self.tokenizer_digest = self._tokenizer_digest()
        self._setup = compile_worker.setup_message(self.tokenizer_info.serialize_json(), self.config.probe)
        self._lock = threading.Lock()
        self._has_jobs = threading.Condition(self._lock)
        self._cache: OrderedDict[str, _Job] = OrderedDict()
        # Queued jobs per owner, served round-robin (an owner's first job moves it to the back).
        self._queues: OrderedDict[str | None, collections.deque[_Job]] = OrderedDict()
        self._running_of: dict[str | None, int] = {}  # owner -> its jobs running
        self._closed = False
        self.num_running = 0  # compiles in progress
        self.num_started = 0  # compiles a worker took
        self.num_killed = 0  # compiles killed: past the timeout, or nobody waited any more
        self._workers: list[_Worker | None] = [None] * self.config.num_threads  # ready ones
        self._starting: dict[int, _Worker] = {}  # slot -> its worker, started and not yet ready
        self._workers_changed = threading.Condition(self._lock)
        self._start_requested = False  # the first job (or start()) has asked for the workers
        self._ready_at: float | None = None  # when the first worker was ready for jobs
        for slot in range(self.config.num_threads):  # each starts its slot's worker when asked to
            threading.Thread(target=self._supervise, args=(slot,), name=f"grammar-compile-{slot}",
                             daemon=True).start()

    def start(self) -> None:
        """Start every worker now and wait until they are ready (otherwise the first constraint
        starts them). Raises RuntimeError when they are not ready within ``start_timeout_s``."""
        with self._lock:
            self._request_start()
            if not self._workers_changed.wait_for(
                    lambda: self._closed or all(w is not None for w in self._workers), self.config.start_timeout_s):
                raise RuntimeError(f"the grammar compile workers did not start within {self.config.start_timeout_s} s")

    def _request_start(self) -> None:  # under the lock
        if not self._start_requested:
            self._start_requested = True
            self._has_jobs.notify_all()  # every supervisor starts its worker (they import in parallel)

    def _tokenizer_digest(self) -> str:
        info = self.tokenizer_info
        h = hashlib.sha256(json.dumps([info.vocab_size, info.vocab_type.name, info.stop_token_ids]).encode())
        for token in info.decoded_vocab:
            h.update(len(token).to_bytes(4, "little"))
            h.update(token)
        return h.hexdigest()

    def cache_key(self, constraint: Constraint) -> str:
        return hashlib.sha256(f"{self.tokenizer_digest}|{COMPILE_OPTIONS}|{constraint.digest()}".encode()).hexdigest()

    def worker_pids(self) -> list[int]:
        """The ready worker processes' ids (none before the first constraint or ``start()``; fewer
        than ``num_threads`` while they start or a killed one is replaced; tests check that none
        outlives ``close``)."""
        return [w.process.pid for w in self._workers if w is not None]

    def close(self) -> None:
        """Stop the workers (a compile in progress is killed); waiting callers get no answer."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, [None] * len(self._workers)
            starting = list(self._starting.values())
            self._has_jobs.notify_all()
            self._workers_changed.notify_all()
        for worker in workers:
            if worker is not None:
                worker.kill()
        for worker in starting:  # its supervisor, waiting for it to be ready, sees the pipe close
            worker.process.kill()
            worker.process.wait()

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- callers -----------------------------------------------------------------------------

    def compile(self, constraint: Constraint, owner: str | None = None) -> xgr.CompiledGrammar:
        """Blocking compile (in-process callers). Raises InvalidArgument naming the field when the
        constraint is invalid or too costly, ResourceExhaustedError when every worker is busy or
        ``owner`` (a tenant; None: no quota) has its quota of compiles in progress."""
        job, since = self._submit(constraint, owner), time.monotonic()
        try:
            while True:
                timeout = self._queued_wait(job, since)
                try:
                    return self._result(job, job.future.result(timeout=timeout))
                except concurrent.futures.TimeoutError:
                    self._check_started(job, since)
        finally:
            self._leave(job)

    async def compile_async(self, constraint: Constraint, owner: str | None = None) -> xgr.CompiledGrammar:
        """``compile`` for the event loop: it waits without blocking the loop. A cancelled caller
        stops waiting, and a job nobody else waits for is dropped."""
        job, since = self._submit(constraint, owner), time.monotonic()
        try:
            if job.future.done():
                return self._result(job, job.future.result())
            waiter = self._waiter(job)
            while True:
                timeout = self._queued_wait(job, since)
                done, _ = await asyncio.wait({waiter}, timeout=timeout)
                if done:
                    return self._result(job, waiter.result())
                self._check_started(job, since)
        finally:
            self._leave(job)

    @staticmethod
    def _waiter(job: _Job) -> asyncio.Future:
        """An event-loop future that follows the job's. Not ``asyncio.wrap_future``: cancelling that
        would cancel the job's future, which other callers may share, and a compile that ends
        after the loop closed must not raise in the supervisor."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def copy(done: concurrent.futures.Future) -> None:  # on the loop
            if waiter.done():
                return
            if done.exception() is not None:
                waiter.set_exception(done.exception())
            else:
                waiter.set_result(done.result())

        def on_done(done: concurrent.futures.Future) -> None:  # in the supervisor thread
            try:
                loop.call_soon_threadsafe(copy, done)
            except RuntimeError:
                pass  # the event loop is closed (the service is exiting): nobody waits any more

        job.future.add_done_callback(on_done)
        return waiter

    def new_matcher(self, grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A fresh matcher (its own state) over a shared compiled grammar: one per completion."""
        return xgr.GrammarMatcher(grammar)

    # --- internals ---------------------------------------------------------------------------

    @staticmethod
    def _normalized(constraint: Constraint) -> Constraint:
        if constraint.kind != "json_schema":
            return constraint
        try:
            return Constraint("json_schema", normalized_json_schema(constraint.spec))
        except (ValueError, RecursionError):
            return constraint  # not JSON: the worker says why

    def _submit(self, constraint: Constraint, owner: str | None) -> _Job:
        constraint = self._normalized(constraint)
        key = self.cache_key(constraint)
        with self._lock:
            if self._closed:
                raise ResourceExhaustedError(f"params.{constraint.kind}: the grammar compiler is shut down")
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
            else:
                job = self._cache[key] = _Job(constraint, key, owner)
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)  # waiters still hold their job
                self._queues.setdefault(owner, collections.deque()).append(job)
                self._has_jobs.notify()
                self._request_start()
            job.num_waiters += 1
        return job

    def _leave(self, job: _Job) -> None:
        """A caller stops waiting: a queued job nobody waits for is dropped (a running one is
        killed by its supervisor, which looks every _POLL_S)."""
        with self._lock:
            job.num_waiters -= 1
            if job.num_waiters == 0 and job.state == "queued":
                self._drop(job)

    def _drop(self, job: _Job) -> None:  # under the lock
        job.state = "dropped"
        self._uncache(job)
        job.future.set_result((None, "dropped: nobody waited for it"))

    def _uncache(self, job: _Job) -> None:  # under the lock
        if self._cache.get(job.key) is job:
            del self._cache[job.key]  # not a verdict: whoever asks again compiles afresh

    def _finished(self, job: _Job) -> None:  # under the lock: a running job ended, its owner may run another
        self.num_running -= 1
        self._running_of[job.owner] -= 1
        if not self._running_of[job.owner]:
            del self._running_of[job.owner]
        self._has_jobs.notify()

    def _queued_wait(self, job: _Job, since: float) -> float | None:
        """How long a caller still waits for a queued job to start (None: it runs; the supervisor
        answers within the timeout). While the workers start, the wait is not counted: it is
        looked at again every _BOOT_POLL_S, up to ``start_timeout_s``."""
        if job.started_at is not None:
            return None
        now, ready_at = time.monotonic(), self._ready_at
        if ready_at is None:
            return min(_BOOT_POLL_S, max(0.0, since + self.config.start_timeout_s - now))
        return max(0.0, max(since, ready_at) + self.config.timeout_s - now)

    def _check_started(self, job: _Job, since: float) -> None:
        """A queued job's wait ran out: raise unless it has started meanwhile (or the workers are
        still starting, within ``start_timeout_s``)."""
        if job.started_at is not None:
            return
        kind, quota = job.constraint.kind, self.config.max_jobs_per_tenant
        if self._closed:
            raise ResourceExhaustedError(f"params.{kind}: the grammar compiler is shut down")
        if self._ready_at is None:
            if time.monotonic() < since + self.config.start_timeout_s:
                return
            raise ResourceExhaustedError(f"params.{kind}: the grammar compile workers did not start within "
                                         f"{self.config.start_timeout_s} s; retry later")
        if job.owner is not None and self._running_of.get(job.owner, 0) >= quota:
            raise ResourceExhaustedError(f"params.{kind}: this tenant's other grammar compiles take the "
                                         f"{quota} worker(s) a tenant may use; retry later")
        raise ResourceExhaustedError(f"params.{kind}: every grammar compile worker is busy; retry later")

    def _too_costly(self, job: _Job) -> str:
        return f"compiling took more than {self.config.timeout_s} s of CPU; the constraint is too complex"

    @staticmethod
    def _result(job: _Job, result: tuple[xgr.CompiledGrammar | None, str | None]) -> xgr.CompiledGrammar:
        grammar, error = result
        if grammar is None:
            raise InvalidArgument(f"params.{job.constraint.kind}: {error}")
        return grammar

    def _next_job(self) -> _Job | None:
        with self._lock:
            while True:
                if self._closed:
                    return None
                for owner in list(self._queues):
                    queue = self._queues[owner]
                    while queue and queue[0].state != "queued":
                        queue.popleft()  # dropped: nobody waited
                    if not queue:
                        del self._queues[owner]
                        continue
                    if owner is not None and self._running_of.get(owner, 0) >= self.config.max_jobs_per_tenant:
                        continue
                    job = queue.popleft()
                    self._queues.move_to_end(owner)
                    job.state, job.started_at = "running", time.monotonic()
                    self.num_running += 1
                    self.num_started += 1
                    self._running_of[owner] = self._running_of.get(owner, 0) + 1
                    return job
                self._has_jobs.wait()

    def _supervise(self, slot: int) -> None:
        with self._lock:
            self._has_jobs.wait_for(lambda: self._closed or self._start_requested)
        self._restart(slot)  # the slot's first worker (returns at once when closed)
        while (job := self._next_job()) is not None:
            killed = False
            try:
                outcome, killed = self._run(slot, job)
            except BaseException as exc:  # a bug (or the compiler closed under it): never lost
                with self._lock:
                    self._finished(job)
                    if self._closed:
                        return
                log.exception("grammar_compile_failed", kind=job.constraint.kind)
                job.future.set_exception(exc)
                self._restart(slot)
                continue
            with self._lock:
                self._finished(job)
                if outcome is None:  # killed: nobody waited
                    self._drop(job)
                elif outcome is _STARVED:  # not a verdict: whoever asks again compiles afresh
                    self._uncache(job)
                    job.state = "done"
                    job.future.set_exception(ResourceExhaustedError(
                        f"params.{job.constraint.kind}: the machine is too busy to compile this constraint "
                        f"now (it got under {self.config.timeout_s} s of CPU in "
                        f"{time.monotonic() - job.started_at:.1f} s); retry later"))
                else:
                    job.state = "done"
            if outcome is not None and outcome is not _STARVED:
                log.debug("grammar_compiled", kind=job.constraint.kind, ok=outcome[0] is not None,
                          seconds=round(time.monotonic() - job.started_at, 4))
                job.future.set_result(outcome)  # the verdict first, then the slot's new worker
            if killed:
                self._restart(slot)

    def _run(self, slot: int, job: _Job) -> tuple[tuple[xgr.CompiledGrammar | None, str | None] | None, bool]:
        """The job on the slot's worker: (its outcome, or None when it was killed because nobody
        waited for it any more; whether the worker was killed). A worker past the timeout is killed."""
        worker = self._workers[slot]
        c = job.constraint
        cpu_at_start = worker.cpu_seconds()
        worker.to_worker.send((c.kind, c.spec, c.choices))
        limit_s = self.config.timeout_s
        wall_deadline = job.started_at + (limit_s if cpu_at_start is None else
                                          max(WALL_LIMIT_FACTOR * limit_s, MIN_WALL_LIMIT_S))
        while not worker.from_worker.poll(min(_POLL_S, max(0.0, wall_deadline - time.monotonic()))):
            if job.num_waiters == 0:
                self._kill(slot)
                return None, True
            cpu_s = None if cpu_at_start is None else worker.cpu_seconds() - cpu_at_start
            is_past_wall = time.monotonic() >= wall_deadline
            if (cpu_s is not None and cpu_s >= limit_s) or (cpu_s is None and is_past_wall):
                self._kill(slot)
                log.warning("grammar_compile_timeout", kind=c.kind, timeout_s=limit_s,
                            num_chars=len(c.spec) + sum(map(len, c.choices)))
                return (None, self._too_costly(job)), True
            if is_past_wall:
                self._kill(slot)
                log.warning("grammar_compile_starved", kind=c.kind, cpu_s=round(cpu_s, 3),
                            wall_s=round(time.monotonic() - job.started_at, 3), action="told to retry")
                return _STARVED, True
        status, payload = worker.from_worker.recv()
        if status == "ok":
            return (xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info), None), False
        return (None, payload), False

    def _kill(self, slot: int) -> None:
        worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.kill()
        with self._lock:
            self.num_killed += 1

    def _restart(self, slot: int) -> None:
        """A fresh worker in the slot (the supervisor waits for it: its slot takes no job meanwhile)."""
        old = self._workers[slot]
        if old is not None:
            old.kill()
        while True:
            try:
                with self._lock:
                    if self._closed:
                        return
                    worker = self._starting[slot] = _Worker()  # known to close() while it starts
                worker.start(self._setup, self.config.start_timeout_s)
            except (OSError, RuntimeError, EOFError):
                with self._lock:
                    failed = self._starting.pop(slot, None)
                    closed = self._closed
                if failed is not None:
                    failed.kill()
                if closed:  # close() killed it while it started
                    return
                log.exception("grammar_worker_start_failed", slot=slot)
                time.sleep(1.0)
                continue
            with self._lock:
                del self._starting[slot]
                if self._closed:
                    worker.kill()
                    return
                self._workers[slot] = worker
                if self._ready_at is None:
                    self._ready_at = time.monotonic()
                self._workers_changed.notify_all()
            return
