"""Client of the memory service, used by the compute service (and by tests and benchmarks).

Attaches, maps the pool, keeps its lease alive with a KeepAlive stream, and turns core ops into one
Step RPC. Protobuf stays at this edge: callers pass and get the block manager's dataclasses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import grpc

from pagedserve.errors import PreconditionError, UnavailableError
from pagedserve.memory.v1 import memory_pb2 as pb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.trace_context import TRACEPARENT

from memory_service import convert
from memory_service.manager.block_types import AppendOp, BlockManagerStats, Op, OpResult, ReservedPool, StepResult
from memory_service.pool.mapped_pool import MappedPool
from memory_service.pool.kv_pool import KvLayout

# The one definition of "the memory service is gone": nobody answers in time (or the call was
# cut off by the channel closing) ...
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# ... or, once attached, it answers that it no longer knows this client (restarted, lease expired).
_GONE = (*_UNREACHABLE, grpc.StatusCode.FAILED_PRECONDITION)


class MemoryServiceUnavailable(UnavailableError):
    """The memory service cannot be reached, or no longer knows this client (it restarted, or the
    lease expired). The client is unusable: close it and attach a new one when the service is back."""


def channel_target(socket: str | None = None, address: str | None = None) -> str:
    """gRPC target for a Unix socket path or a TCP host:port (exactly one)."""
    if (socket is None) == (address is None):
        raise ValueError("give exactly one of socket or address")
    return f"unix:{socket}" if socket is not None else address


class MemoryClient:
    """One attached client: ``step_with_counts(ops)`` per scheduler step; ``pool`` is the mapped KV tensor.

    Synchronous and meant for one owner thread (the engine loop); a background thread holds the
    KeepAlive stream and reopens it when it ends for a transient reason.

    Losing the memory service: ``step``/``step_with_counts`` raise ``MemoryServiceUnavailable`` when
    the service does not answer within ``step_timeout_s``, is down, or no longer knows this client
    (it restarted with a new pool, or the lease expired after the KeepAlive stream was down for
    longer than the lease TTL). ``is_connected`` turns False as soon as the KeepAlive thread sees the
    stream fail, so an owner can also poll it between steps. Either way the owner should report
    itself unhealthy, fail its in-flight requests, ``close()`` this client and attach a new one (a
    new pool mapping) once the service answers again; a client whose lease is lost never recovers.

    Every step also tells the service that the K/V of the previous step's tokens is written (commit
    before share; ``commit()`` when there is no next step).

    Args:
        target: gRPC target ("unix:/path" or "host:port").
        layout: the KV layout the model needs.
        client_name: name for the service's logs and stats.
        connect_timeout_s: how long to wait for the service to answer.
        step_timeout_s: deadline of each Step call.
        attach_timeout_s: deadline of the Attach call (None: ``connect_timeout_s``). The first
            attach creates the pool, allocating and mapping all of it: seconds a GiB on a CPU.
        token: the memory service's token, sent on every call (``authorization: Bearer TOKEN``):
            with it this client is trusted (any cache namespace; memory_service/service/trust.py).
        model_fingerprint: the model weights' fingerprint (compute_service/model/fingerprint.py),
            sent at Attach: with it (and the token) this client uses the service's KV tier.
    """

    def __init__(self, target: str, layout: KvLayout, client_name: str = "compute", connect_timeout_s: float = 30.0,
                 step_timeout_s: float = 30.0, attach_timeout_s: float | None = None,
                 token: str | None = None, model_fingerprint: str = "") -> None:
        self._channel = grpc.insecure_channel(target)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._closed = threading.Event()
        self._lease_lost = False
        self._stream_ok = True
        self._step_timeout_s = step_timeout_s
        try:
            try:
                grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
            except grpc.FutureTimeoutError:
                raise MemoryServiceUnavailable(
                    f"memory service at {target}: no answer in {connect_timeout_s} s") from None
            self._stub = memory_pb2_grpc.MemoryManagerStub(self._channel)
            reply = self._attach(pb.AttachRequest(client_name=client_name, layout=convert.layout_to_pb(layout),
                                                  model_fingerprint=model_fingerprint),
                                 connect_timeout_s if attach_timeout_s is None else attach_timeout_s)
        except BaseException:
            self._channel.close()
            raise
        self.client_id = reply.client_id
        self.num_blocks = reply.num_blocks
        self.block_size = reply.block_size
        self.reserved = ReservedPool(reply.num_reserved_blocks, reply.reserved_min_priority)
        self.lease_ttl_s = reply.lease_ttl_s
        # Clients with the same id share the pool; the compute service reports both in its Info.
        self.memory_service_id = reply.memory_service_id
        self.memory_service_epoch = reply.memory_service_epoch  # new at each of its starts (identity.py)
        self.tiers = convert.tiers_from_pb(reply.tiers)
        try:
            self._mapped = MappedPool(convert.descriptor_from_pb(reply.pool), layout, reply.num_blocks)
        except BaseException:
            self._detach()
            self._channel.close()
            raise
        self.pool = self._mapped.tensor  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # The traceparent of a step's ops, if a traced request needs it (the compute service's
        # request spans set it when traces are on): sent with that Step only (docs/design.md, "Traces").
        self.traceparent_of: Callable[[Sequence[Op]], str | None] | None = None
        self._keepalive_call: grpc.Future | None = None
        self._keepalive_lock = threading.Lock()
        self._keepalive_thread = threading.Thread(target=self._keep_alive, name="memory-keepalive", daemon=True)
        self._keepalive_thread.start()

    # --- lease ------------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        """False once the KeepAlive stream has failed (until it reopens), or for good once the lease
        is lost or the client closed. A step may still raise ``MemoryServiceUnavailable`` while True."""
        return self._stream_ok and not self._lease_lost and not self._closed.is_set()

    def _keep_alive(self) -> None:
        """Holds a KeepAlive stream open; reopens it after a transient end, with backoff."""
        backoff_s = 0.05
        while not self._closed.is_set():
            with self._keepalive_lock:
                if self._closed.is_set():
                    return
                call = self._stub.KeepAlive(pb.KeepAliveRequest(client_id=self.client_id), metadata=self._metadata)
                self._keepalive_call = call
            try:
                for _ in call:
                    self._stream_ok = True
                    backoff_s = 0.05
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._lease_lost = True  # the service no longer knows us: only a new attach helps
                    return
                self._stream_ok = exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            # Ended (the server stopping, a proxy, a cancelled call): reopen unless closing.
            if self._closed.wait(backoff_s):
                return
            backoff_s = min(backoff_s * 2, 1.0)

    # --- steps ------------------------------------------------------------------------------

    def step(self, ops: Sequence[Op]) -> list[OpResult]:
        """Apply ops in one RPC; one result per op (``ok=False`` = out of blocks for that op)."""
        return self.step_with_counts(ops).results

    def step_with_counts(self, ops: Sequence[Op], prefill_tokens_per_s: float = 0.0) -> StepResult:
        """Like ``step``, plus the available block counts after it (what the scheduler plans with)
        and the sequences whose tier load ended. ``prefill_tokens_per_s``: this engine's measured
        prefill speed (0 = unknown), for the service's choice between loading and recomputing.

        Raises:
            MemoryServiceUnavailable: see the class docstring.
            grpc.RpcError: INVALID_ARGUMENT for a bad batch (a caller bug; nothing was applied).
        """
        if self._lease_lost:
            raise MemoryServiceUnavailable(f"the memory service no longer knows client {self.client_id}: attach again")
        # Pack the longest run of appends (the running sequences' growth) into an AppendBatch;
        # the ops before it travel as ops, those after it as late_ops, so the order is kept.
        first = next((i for i, op in enumerate(ops) if isinstance(op, AppendOp)), len(ops))
        end = first
        while end < len(ops) and isinstance(ops[end], AppendOp):
            end += 1
        request = pb.StepRequest(
            client_id=self.client_id,
            ops=[convert.op_to_pb(op) for op in ops[:first]],
            appends=convert.appends_to_pb(list(ops[first:end])),
            late_ops=[convert.op_to_pb(op) for op in ops[end:]],
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        traceparent = self.traceparent_of(ops) if self.traceparent_of is not None and ops else None
        metadata = self._metadata if traceparent is None else (*(self._metadata or ()), (TRACEPARENT, traceparent))
        reply = self._call(self._stub.Step, request, metadata)
        results = [convert.result_from_pb(r) for r in reply.results]
        results[first:first] = convert.append_results_from_pb(reply.append_results)
        return StepResult(results, reply.num_available_blocks, reply.num_available_reserved_blocks,
                          list(reply.loaded_seq_ids))

    def commit(self) -> None:
        """Tells the service that the K/V of the last step is written (an empty Step), so other
        clients may share the blocks it filled. Steps do this by themselves for the step before."""
        self.step_with_counts([])

    def block_table(self, seq_id: str) -> list[int]:
        """The whole block table of one of this client's sequences."""
        request = pb.GetBlockTableRequest(client_id=self.client_id, seq_id=seq_id)
        return list(self._call(self._stub.GetBlockTable, request).block_ids)

    def stats(self) -> BlockManagerStats:
        """The service's block, cache and client statistics."""
        return convert.stats_from_pb(self._call(self._stub.Stats, pb.StatsRequest()))

    def check_integrity(self) -> str | None:
        """The service's own integrity check: None when it holds, else the first broken invariant."""
        reply = self._call(self._stub.CheckIntegrity, pb.CheckIntegrityRequest())
        return None if reply.ok else reply.problem

    def ping(self) -> None:
        """Raises ``MemoryServiceUnavailable`` unless the service answers (the idle owner's check)."""
        self._call(self._stub.Ping, pb.PingRequest())

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object,
              metadata: tuple[tuple[str, str], ...] | None = None) -> object:
        """Every RPC after Attach: the codes of ``_GONE`` become ``MemoryServiceUnavailable``."""
        try:
            return method(request, timeout=self._step_timeout_s, metadata=metadata or self._metadata)
        except grpc.RpcError as exc:
            if exc.code() not in _GONE:
                raise
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._lease_lost = True
            raise MemoryServiceUnavailable(f"memory service: {exc.code().name}: {exc.details()}") from exc

    def _attach(self, request: pb.AttachRequest, timeout_s: float) -> pb.AttachResponse:
        """Attach, whose FAILED_PRECONDITION is a refusal (a layout that differs from the pool's),
        not a lost lease: an operator must act, so it is a ``PreconditionError``, not "gone"."""
        try:
            return self._stub.Attach(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() in _UNREACHABLE:
                raise MemoryServiceUnavailable(f"memory service: {exc.code().name}: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise PreconditionError(f"memory service refused to attach: {exc.details()}") from exc
            raise

    # --- end --------------------------------------------------------------------------------

    def _detach(self) -> None:
        try:
            self._stub.Detach(pb.DetachRequest(client_id=self.client_id), timeout=5, metadata=self._metadata)
        except grpc.RpcError:
            pass  # the service is gone or already expired the lease: nothing left to free

    def close(self) -> None:
        """Detach (freeing this client's sequences) and drop the mapping."""
        if self._closed.is_set():
            return
        with self._keepalive_lock:
            self._closed.set()
            if self._keepalive_call is not None:
                self._keepalive_call.cancel()
        if not self._lease_lost:
            self._detach()
        self._keepalive_thread.join(timeout=5)
        self._mapped.close()
        self.pool = None
        self._channel.close()

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
