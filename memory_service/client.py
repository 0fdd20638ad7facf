"""Client of the memory service, used by the compute service (and by tests and benchmarks).

Attaches, maps the pool, keeps its lease alive with a KeepAlive stream, and turns core ops into one
Step RPC. Protobuf stays at this edge: callers pass and get the block manager's dataclasses.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import grpc

from pagedserve.memory.v1 import memory_pb2 as pb
from pagedserve.memory.v1 import memory_pb2_grpc

from memory_service import convert
from memory_service.block_manager import AppendOp, OpResult
from memory_service.pool import KvLayout, MappedPool


class StepResult(NamedTuple):
    """Answer to one Step: a result per op, and the blocks available for the next step."""

    results: list[OpResult]
    num_available_blocks: int
    num_available_reserved_blocks: int


def channel_target(socket: str | None = None, address: str | None = None) -> str:
    """gRPC target for a Unix socket path or a TCP host:port (exactly one)."""
    if (socket is None) == (address is None):
        raise ValueError("give exactly one of socket or address")
    return f"unix:{socket}" if socket is not None else address


class MemoryClient:
    """One attached client: ``step(ops)`` per scheduler step, ``pool`` is the mapped KV tensor.

    Args:
        target: gRPC target ("unix:/path" or "host:port").
        layout: the KV layout the model needs.
        client_name: name for the service's logs and stats.
        connect_timeout_s: how long to wait for the service to answer.
    """

    def __init__(self, target: str, layout: KvLayout, client_name: str = "compute", connect_timeout_s: float = 30.0) -> None:
        self._channel = grpc.insecure_channel(target)
        grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
        self._stub = memory_pb2_grpc.MemoryManagerStub(self._channel)
        reply = self._stub.Attach(pb.AttachRequest(client_name=client_name, layout=convert.layout_to_pb(layout)))
        self.client_id = reply.client_id
        self.num_blocks = reply.num_blocks
        self.block_size = reply.block_size
        self.num_reserved_blocks = reply.num_reserved_blocks
        self.reserved_min_priority = reply.reserved_min_priority
        self._mapped = MappedPool(convert.descriptor_from_pb(reply.pool))
        self.pool = self._mapped.tensor  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self._keepalive = self._stub.KeepAlive(pb.KeepAliveRequest(client_id=self.client_id))
        self._keepalive_thread = threading.Thread(target=self._drain_keepalive, name="memory-keepalive", daemon=True)
        self._keepalive_thread.start()
        self._closed = False

    def _drain_keepalive(self) -> None:
        try:
            for _ in self._keepalive:
                pass
        except grpc.RpcError:
            pass  # cancelled on close, or the service went away; the next step() reports the latter

    def step(self, ops: Sequence) -> list[OpResult]:
        """Apply ops in one RPC; one result per op (``ok=False`` = out of blocks for that op)."""
        return self.step_with_counts(ops).results

    def step_with_counts(self, ops: Sequence) -> StepResult:
        """Like ``step``, plus the available block counts after it (what the scheduler plans with)."""
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
        )
        reply = self._stub.Step(request)
        results = [convert.result_from_pb(r) for r in reply.results]
        results[first:first] = convert.append_results_from_pb(reply.append_results)
        return StepResult(results, reply.num_available_blocks, reply.num_available_reserved_blocks)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._stub.GetBlockTable(pb.GetBlockTableRequest(client_id=self.client_id, seq_id=seq_id)).block_ids)

    def stats(self) -> pb.StatsResponse:
        return self._stub.Stats(pb.StatsRequest())

    def ping(self) -> None:
        self._stub.Ping(pb.PingRequest())

    def close(self) -> None:
        """Detach (freeing this client's sequences) and drop the mapping."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stub.Detach(pb.DetachRequest(client_id=self.client_id), timeout=5)
        except grpc.RpcError:
            pass  # the service is gone or already expired the lease: nothing left to free
        self._keepalive.cancel()
        self._mapped.close()
        self.pool = None
        self._channel.close()

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
