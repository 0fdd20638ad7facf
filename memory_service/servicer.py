"""The MemoryManager gRPC servicer: the pool, the block manager and client leases behind one lock."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import grpc

from pagedserve.errors import PreconditionError
from pagedserve.log import get_logger
from pagedserve.memory.v1 import memory_pb2 as pb
from pagedserve.memory.v1 import memory_pb2_grpc

from memory_service import convert
from memory_service.block_manager import BlockManager, BlockManagerConfig
from memory_service.config import MemoryServiceConfig
from memory_service.pool import KvLayout, KvPool, create_pool, free_device_bytes

log = get_logger("memory_service")

# A single Step may not carry more ops than this (a guard against absurd requests).
MAX_OPS_PER_STEP = 65536


@dataclass
class Lease:
    name: str
    last_seen: float
    num_streams: int = 0  # open KeepAlive streams; a lease with one never expires by time


class MemoryManagerServicer(memory_pb2_grpc.MemoryManagerServicer):
    """Owns the KV pool (created at the first attach) and the block manager.

    Every RPC takes ``self._lock``: the block manager is single-threaded by design, and one lock
    around a batched step is far cheaper than the RPC itself.
    """

    def __init__(self, config: MemoryServiceConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.layout: KvLayout | None = None
        self.pool: KvPool | None = None
        self.block_manager: BlockManager | None = None
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap_expired_leases, name="lease-reaper", daemon=True)
        self._reaper.start()

    # --- pool -------------------------------------------------------------------------------

    def _num_blocks_for(self, layout: KvLayout) -> int:
        cfg = self.config
        if cfg.max_num_blocks is not None:
            return cfg.max_num_blocks
        budget = cfg.kv_cache_bytes
        if budget is None:
            budget = int(free_device_bytes(cfg.device) * cfg.memory_utilization_threshold)
        num_blocks = budget // layout.bytes_per_block
        if num_blocks < 1:
            raise PreconditionError(
                f"a KV budget of {budget} bytes holds no block of {layout.bytes_per_block} bytes for this layout"
            )
        return num_blocks

    def _ensure_pool(self, layout: KvLayout) -> None:
        if self.pool is not None:
            if layout != self.layout:
                raise PreconditionError(f"layout {layout} does not fit the existing pool's layout {self.layout}")
            return
        if layout.block_size != self.config.block_size:
            raise PreconditionError(
                f"layout.block_size {layout.block_size} differs from the service's block_size {self.config.block_size}"
            )
        num_blocks = self._num_blocks_for(layout)
        reserved = int(num_blocks * self.config.reserved_fraction)
        bm_config = BlockManagerConfig(
            num_blocks=num_blocks,
            block_size=layout.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            reserved_blocks=reserved,
            reserved_min_priority=self.config.reserved_min_priority,
        )
        self.pool = create_pool(layout, num_blocks, self.config.device)
        self.layout = layout
        self.block_manager = BlockManager(bm_config, copy_block=self.pool.copy_block)
        log.info(
            "pool_created",
            num_blocks=num_blocks,
            reserved_blocks=reserved,
            num_bytes=self.pool.descriptor().num_bytes,
            layout=str(layout),
        )

    # --- leases -----------------------------------------------------------------------------

    def _lease(self, client_id: str) -> Lease:
        lease = self._leases.get(client_id)
        if lease is None:
            raise ValueError(f"client_id {client_id!r} is not attached (never attached, detached or lease expired)")
        lease.last_seen = time.monotonic()
        return lease

    def _release(self, client_id: str, reason: str) -> int:
        lease = self._leases.pop(client_id, None)
        if lease is None or self.block_manager is None:
            return 0
        num_freed = self.block_manager.release_client(client_id)
        log.info("client_released", client_id=client_id, client_name=lease.name, reason=reason, num_freed=num_freed)
        return num_freed

    def _reap_expired_leases(self) -> None:
        ttl = self.config.lease_ttl_s
        while not self._stopped.wait(min(1.0, ttl / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [
                    cid for cid, lease in self._leases.items() if lease.num_streams == 0 and now - lease.last_seen > ttl
                ]
                for cid in expired:
                    self._release(cid, "lease_expired")

    # --- RPCs -------------------------------------------------------------------------------

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        layout = convert.layout_from_pb(request.layout, self.config.block_size)
        with self._lock:
            self._ensure_pool(layout)
            client_id = f"{request.client_name or 'client'}-{secrets.token_hex(6)}"
            self.block_manager.add_client(client_id)
            self._leases[client_id] = Lease(name=request.client_name, last_seen=time.monotonic())
            bm_config = self.block_manager.config
            log.info("client_attached", client_id=client_id)
            return pb.AttachResponse(
                client_id=client_id,
                pool=convert.descriptor_to_pb(self.pool.descriptor()),
                num_blocks=bm_config.num_blocks,
                block_size=bm_config.block_size,
                lease_ttl_s=self.config.lease_ttl_s,
                num_reserved_blocks=bm_config.reserved_blocks,
                reserved_min_priority=bm_config.reserved_min_priority,
            )

    def Detach(self, request: pb.DetachRequest, context: grpc.ServicerContext) -> pb.DetachResponse:
        with self._lock:
            self._lease(request.client_id)
            return pb.DetachResponse(num_freed_sequences=self._release(request.client_id, "detach"))

    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext):
        if request.interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {request.interval_s}")
        interval = request.interval_s or max(0.05, self.config.lease_ttl_s / 3)
        with self._lock:
            lease = self._lease(request.client_id)
            lease.num_streams += 1
        ended = threading.Event()
        context.add_callback(ended.set)  # runs when the client goes away (or cancels)
        try:
            while context.is_active() and not self._stopped.is_set():
                yield pb.KeepAliveResponse(server_time=time.time())
                if ended.wait(interval):
                    break
        finally:
            with self._lock:
                lease = self._leases.get(request.client_id)
                if lease is not None:
                    lease.num_streams -= 1
                    if lease.num_streams == 0:
                        # The client's process is gone (or it closed its stream): reclaim at once
                        # rather than waiting for the TTL.
                        self._release(request.client_id, "keepalive_ended")

    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        num_ops = len(request.ops) + len(request.appends.seq_ids) + len(request.late_ops)
        if num_ops > MAX_OPS_PER_STEP:
            raise ValueError(f"the step has {num_ops} ops; at most {MAX_OPS_PER_STEP} per step")
        early = [convert.op_from_pb(op) for op in request.ops]
        appends = convert.appends_from_pb(request.appends)
        late = [convert.op_from_pb(op) for op in request.late_ops]
        with self._lock:
            self._lease(request.client_id)
            if self.block_manager is None:
                raise PreconditionError("no pool yet: attach first")
            # One apply() so that validation covers the whole step before anything changes.
            results = self.block_manager.apply(request.client_id, [*early, *appends, *late])
            num_available, num_available_reserved = self.block_manager.num_available_blocks()
        num_early = len(early)
        return pb.StepResponse(
            results=[convert.result_to_pb(r) for r in results[:num_early] + results[num_early + len(appends):]],
            append_results=convert.append_results_to_pb(results[num_early : num_early + len(appends)]),
            num_available_blocks=num_available,
            num_available_reserved_blocks=num_available_reserved,
        )

    def GetBlockTable(self, request: pb.GetBlockTableRequest, context: grpc.ServicerContext) -> pb.GetBlockTableResponse:
        with self._lock:
            self._lease(request.client_id)
            if not self.block_manager.has_sequence(request.seq_id):
                raise ValueError(f"seq_id {request.seq_id!r} is not a live sequence")
            return pb.GetBlockTableResponse(block_ids=self.block_manager.block_table(request.seq_id))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with self._lock:
            return self.stats_pb()

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse()

    # --- helpers ----------------------------------------------------------------------------

    def stats_pb(self) -> pb.StatsResponse:
        """Stats as protobuf; call with the lock held. Before the first attach there is no pool."""
        if self.block_manager is None:
            return pb.StatsResponse(num_clients=len(self._leases), block_size=self.config.block_size)
        s = self.block_manager.stats()
        return pb.StatsResponse(
            pools=[
                pb.PoolStats(
                    name=p.name,
                    num_total_blocks=p.num_total_blocks,
                    num_free_blocks=p.num_free_blocks,
                    num_cached_blocks=p.num_cached_blocks,
                    num_used_blocks=p.num_used_blocks,
                )
                for p in s.pools
            ],
            kv_utilization=s.kv_utilization,
            fragmentation=s.fragmentation,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_evictions=s.num_evictions,
            num_copy_on_writes=s.num_copy_on_writes,
            num_sequences=s.num_sequences,
            num_clients=len(self._leases),
            block_size=self.block_manager.config.block_size,
        )

    def close(self) -> None:
        """Stop the reaper and free the pool (the shared-memory name is unlinked)."""
        self._stopped.set()
        with self._lock:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
