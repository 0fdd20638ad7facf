"""The engine in its own thread: requests in and outputs out through thread-safe hand-offs.

The gRPC server is asyncio; the model forward is long, blocking work. So one thread owns the
``Engine`` (nothing else touches it) and the server talks to it only through ``submit``/``abort``
(a queue of commands) and per-request sinks (callbacks the thread calls with each step's output;
the servicer's sink hands it to its event loop with ``call_soon_threadsafe``). With nothing to do,
the thread sleeps on an event instead of spinning, waking for a command or, every
``ping_interval_s``, to check that the memory service is still there. The first such idle wake
after steps hands the memory the allocator keeps for the steps' activations back to the system
(``release_free_memory``: ~240 MiB after eight ~1,000-token prompts of a 1.5B model), so an idle server is resident at
its weights, not at its last peak; a busy one keeps it for its next steps.

Losing the memory service (the memory client raises ``MemoryServiceUnavailable``, its one word for
"the service is gone, or no longer knows our lease") ends every request in flight with
``EngineUnavailable``, reports "not ready", and retries
attaching until the service is back: a new lease, a new pool mapping, a new engine around the same
model. A failure tied to one request (its sampling, detokenizing, stop checks) is the engine's to
isolate: that request alone ends, with finish_reason "error", and the step goes on. Any other
failure of a step is a bug: it is logged with its traceback, the requests in flight end with
``EngineFailed``, and the engine is rebuilt the same way (its state is suspect).

A request whose sink reports its consumer's buffer full is paused (see service/stream_buffer.py)
until the consumer sends ``resume``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from pagedserve.cpu_preload import release_free_memory
from pagedserve.errors import AlreadyExistsError, InvalidArgument, UnavailableError, echo
from pagedserve.log import get_logger

from memory_service.api import KvTierInfo, MemoryServiceUnavailable, Op

from compute_service.engine.allocator import KvAllocator
from compute_service.engine.engine import Engine
from compute_service.engine.outputs import RequestDelta
from compute_service.engine.request import EngineLoad, GenerateInput
from compute_service.engine.sampling_params import SamplingParams
from compute_service.service.request_metrics import RequestTimes
from compute_service.service.request_traces import RequestSpans

log = get_logger("engine_loop")

# How often a loop whose requests all wait for blocks (held by other clients) asks again.
WAITING_POLL_S = 0.01


class EngineUnavailable(UnavailableError):
    """The memory service is unreachable: the request cannot run (now)."""


class EngineFailed(Exception):
    """The engine hit a bug while running this request (logged with its traceback)."""


# Where a request's outputs go (called on the loop thread). It returns False when its consumer's
# buffer is full: the loop then pauses the request until ``resume`` (see service/stream_buffer.py).
Sink = Callable[[RequestDelta | Exception], bool]


class MemoryLease(KvAllocator, Protocol):
    """The allocator of a service's engine: a lease on a memory service, which can be lost
    (``memory_service.client.MemoryClient``).

    Attributes:
        memory_service_id: the memory service's identity (leases with the same one share the pool).
        memory_service_epoch: its epoch, new at each of its starts (memory_service/identity.py).
        tiers: its tiers below the pool, fastest first (memory_service/identity.py).
    """

    memory_service_id: str
    memory_service_epoch: str
    tiers: tuple[KvTierInfo, ...]
    # The traceparent a Step's ops carry (memory_service.client.MemoryClient; set when traces are on).
    traceparent_of: Callable[[Sequence[Op]], str | None] | None

    @property
    def is_connected(self) -> bool: ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


class Attached(NamedTuple):
    """What one attach gives the loop: an engine, and the lease its allocator is (the same object)."""

    engine: Engine
    lease: MemoryLease


@dataclass
class LoopTotals:
    """Counters since the service started (they survive re-attaching), for metrics."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    num_failed_requests: int = 0  # ended by a failure of their own (finish_reason "error")
    num_draft_tokens: int = 0  # speculative drafts computed, and accepted (engine/speculative.py)
    num_accepted_draft_tokens: int = 0
    num_memory_releases: int = 0  # idle wakes that handed the allocator's free memory back


@dataclass(frozen=True)
class AddCommand:
    request: GenerateInput
    sink: Sink
    grammar: Any | None = None  # params.constraint compiled off this thread (xgrammar CompiledGrammar)
    arrival_s: float = field(default_factory=time.monotonic)  # handed to the loop (the latency histograms)
    traceparent: str | None = None  # the caller's W3C trace context (used only when traces are on)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class AbortCommand:
    request_id: str


@dataclass(frozen=True)
class ResumeCommand:
    request_id: str


class EngineLoop:
    """Owns an Engine in a thread of its own.

    Args:
        attach: builds a fresh Engine on a new lease of the memory service (raises when unreachable).
        on_ready: called from the loop thread with True once attached, False when the memory
            service is lost (the server's health follows it).
        retry_interval_s: pause between attach attempts.
        ping_interval_s: how often an idle loop checks the memory service.
    """

    def __init__(self, attach: Callable[[], Attached], on_ready: Callable[[bool], None], *,
                 retry_interval_s: float = 0.5, ping_interval_s: float = 1.0) -> None:
        self._attach = attach
        self._on_ready = on_ready
        self.retry_interval_s = retry_interval_s
        self.ping_interval_s = ping_interval_s
        self._commands: queue.SimpleQueue[AddCommand | AbortCommand | ResumeCommand] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._sinks: dict[str, Sink] = {}  # loop thread only
        self.engine: Engine | None = None  # loop thread only (tests may read it when idle)
        # The engine's lease (the same object as engine.memory), for what Info reports of the memory service.
        self.lease: MemoryLease | None = None
        self.load = EngineLoad(0, 0, 0.0, 0.0, 0)  # replaced (never mutated) after each step
        self.totals = LoopTotals()  # written by the loop thread only
        self.request_times = RequestTimes()  # the latency histograms, fed by the loop thread
        self.request_spans: RequestSpans | None = None  # set before ``start`` when traces are on
        self._is_warm = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: AddCommand) -> None:
        """Queue a request; its outputs (or an exception) go to ``command.sink``."""
        self._commands.put(command)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still running (its blocks are freed by the next step)."""
        self._commands.put(AbortCommand(request_id))
        self._wake.set()

    def resume(self, request_id: str) -> None:
        """Schedule a paused request again (its consumer has room for more outputs)."""
        self._commands.put(ResumeCommand(request_id))
        self._wake.set()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread (requests still running end with EngineUnavailable) and detach."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            attached = self._attach_until_ready()
            if attached is None:
                break
            engine, lease = attached
            try:
                self._serve(engine, lease)
            except Exception as exc:  # re-raised as each request's error, never dropped
                if isinstance(exc, UnavailableError):  # the memory client's one word for "gone"
                    log.warning("memory_service_lost", error=str(exc))
                    self._fail_all(EngineUnavailable(f"memory service unavailable: {exc}"))
                else:
                    log.exception("engine_step_failed")
                    self._fail_all(EngineFailed(f"engine failure: {exc!r}"))
                self._on_ready(False)
            finally:
                self.engine = self.lease = None
                lease.close()  # releases the lease (or notices it is already gone)
        self._fail_all(EngineUnavailable("the compute service is shutting down"))

    def _attach_until_ready(self) -> Attached | None:
        last_error = ""
        while not self._stopping.is_set():
            try:
                attached = self._attach()
                try:
                    self._warm_up(attached.engine)
                except BaseException:
                    attached.lease.close()
                    raise
            except Exception as exc:  # unreachable memory service: retry until it is back
                # A service that is down is expected (debug); one that refuses us (a layout or block
                # size that differs from its pool) needs an operator: warn, once per distinct error.
                level = log.debug if isinstance(exc, UnavailableError) else log.warning
                if str(exc) != last_error:
                    level("memory_service_attach_failed", error=str(exc))
                    last_error = str(exc)
                self._drain_commands(None)
                self._wake.wait(self.retry_interval_s)
                self._wake.clear()
                continue
            engine, lease = attached
            if self.request_spans is not None:  # the Steps that admit a traced request carry its traceparent
                lease.traceparent_of = self.request_spans.traceparent_of
            self.engine, self.lease = engine, lease
            self.load = engine.load()
            log.info("engine_attached", client_id=lease.client_id, num_blocks=lease.num_blocks)
            self._on_ready(True)
            return attached
        return None

    def _warm_up(self, engine: Engine) -> None:
        """A one-token request before the first SERVING: the first forward loads the CPU kernels
        (10-20 s on a busy machine), and no client's first request should wait for that."""
        if self._is_warm:
            return
        engine.add_request("warm-up", [0], SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        self._is_warm = True

    def _serve(self, engine: Engine, lease: MemoryLease) -> None:
        stepped = True  # since the last release (the warm-up's step, the first time)
        while not self._stopping.is_set():
            self._wake.clear()
            self._drain_commands(engine)
            if not engine.has_unfinished():
                if not self._wake.wait(self.ping_interval_s):
                    self._check_memory(lease)  # idle: notice a lost memory service without a request
                    if stepped:  # idle a whole interval after steps: their activations' memory back
                        stepped = False
                        engine.runner.model.release_scratch()  # the kernels' own, to the allocator first
                        if release_free_memory() is not None:
                            self.totals.num_memory_releases += 1
                continue
            stepped = True
            num_steps = engine.num_steps
            num_drafts, num_accepted = engine.num_draft_tokens, engine.num_accepted_draft_tokens
            step_start = time.monotonic()
            outputs = engine.step()
            step_end = time.monotonic()
            admitted = self.request_times.stepped(engine, step_start, outputs, step_end)
            if self.request_spans is not None:
                self.request_spans.stepped(admitted, step_start, outputs, step_end)
            if not outputs and engine.num_steps == num_steps:
                self._wake.wait(WAITING_POLL_S)  # requests wait for blocks: poll, do not spin
            self.load = engine.load()  # before the outputs: a client that saw them sees this load
            # Counted before the outputs go out, like the load: a client that saw them sees the counts.
            self.totals.num_steps += 1
            self.totals.num_generated_tokens += sum(len(c.token_ids) for o in outputs for c in o.completions)
            self.totals.num_finished_requests += sum(o.finished for o in outputs)
            self.totals.num_failed_requests += sum(o.finished and o.error is not None for o in outputs)
            self.totals.num_draft_tokens += engine.num_draft_tokens - num_drafts
            self.totals.num_accepted_draft_tokens += engine.num_accepted_draft_tokens - num_accepted
            for out in outputs:
                sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
                if sink is not None and not sink(out) and not out.finished:
                    engine.pause(out.request_id)  # its consumer is behind: no more steps until it resumes

    @staticmethod
    def _check_memory(lease: MemoryLease) -> None:
        """Raise MemoryServiceUnavailable if the memory service is gone or forgot our lease."""
        if not lease.is_connected:  # its KeepAlive stream failed, or the lease is lost
            raise MemoryServiceUnavailable("memory service: the KeepAlive stream is down or the lease is lost")
        lease.ping()

    def _drain_commands(self, engine: Engine | None) -> None:
        """Apply queued commands; with no engine (detached), requests fail at once."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AbortCommand):
                if engine is not None:
                    engine.abort(command.request_id)
                continue
            if isinstance(command, ResumeCommand):
                if engine is not None:
                    engine.resume(command.request_id)
                continue
            if engine is None:
                command.sink(EngineUnavailable("memory service unavailable"))
                continue
            if command.request_id in engine.requests:  # the aborted namesake is not freed yet
                command.sink(AlreadyExistsError(f"request_id {echo(command.request_id)} is already running"))
                continue
            try:
                engine.add(command.request, grammar=command.grammar)
            except (InvalidArgument, AlreadyExistsError) as exc:  # checked by the servicer already; reported
                command.sink(exc)
                continue
            self._sinks[command.request_id] = command.sink
            self.request_times.arrived(command.request_id, command.arrival_s)
            if self.request_spans is not None:
                self.request_spans.arrived(engine, command.request_id, command.traceparent, command.arrival_s)

    def _fail_all(self, exc: Exception) -> None:
        sinks, self._sinks = self._sinks, {}
        self.request_times.forget_all()
        if self.request_spans is not None:
            self.request_spans.forget_all(str(exc))
        for sink in sinks.values():
            sink(exc)
        self._drain_commands(None)
        self.load = EngineLoad(0, 0, 0.0, 0.0, 0)
