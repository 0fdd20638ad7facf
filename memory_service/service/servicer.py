"""The MemoryManager gRPC servicer (grpc.aio): the pool, client leases and trust, over a ``MemoryCore``.

The servicer is the edge: it creates the pool, keeps the leases, decides who is trusted, converts
protobuf to ops and calls the core (memory_service/core.py: the block manager, its lock, the tiers,
the KV events), which ``InProcessAllocator`` stands on too. Every RPC runs on the server's event
loop, so a KeepAlive stream is a suspended coroutine, not a thread: thousands of leases cost no
worker. The loop already serialises the RPCs; the core's lock keeps the metrics thread's
``stats()`` and the tiers' threads out of a half-applied step.

Leases: a client's lease lives while it has a KeepAlive stream open or has called within
``lease_ttl_s``. When the last stream ends the lease is NOT released at once: a stream may end for
a transient reason (a proxy, a broken connection that the client reopens), so the TTL starts then,
and a client that is really gone loses its sequences ``lease_ttl_s`` later. Detach releases at once.

Trust: a client that presents the service's token at Attach is trusted (any cache namespace, the
per-client quota); the others are confined (``trust.py`` says exactly to what).

Tiers (``--kv-host-bytes``, ``--kv-disk-dir``, memory_service/tier): the directory is made at start;
the tiers open (the host tier's buffer allocated, the disk's files indexed, in a worker thread) at
the first Attach of a trusted client with a model fingerprint, which binds them to that model and
the pool's layout. Trusted clients of that fingerprint use them; the others (untrusted, no
fingerprint, another model) never do: their blocks are not kept and they get no tier hits. The
tiers' threads share the core's lock with the RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pagedserve.errors import (
    InvalidArgument,
    PreconditionError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    echo,
)
from pagedserve.log import get_logger
from pagedserve.memory.v1 import memory_pb2 as pb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.service_auth import bearer_token

from memory_service import convert
from memory_service.core import MemoryCore
from memory_service.manager.block_manager import BlockManager, BlockManagerConfig, BlockManagerStats
from memory_service.manager.kv_events import KvEventLog
from memory_service.config import DEFAULT_KV_DISK_BYTES, MAX_NUM_BLOCKS, MemoryServiceConfig
from memory_service.identity import KvTierInfo, new_epoch, service_id
from memory_service.pool.kv_pool import (
    KvLayout,
    KvPool,
    check_host_tier_space,
    check_shm_space,
    create_pool,
    default_kv_budget,
)
from memory_service.service import trust
from memory_service.service.step_traces import StepTrace, StepTraces
from memory_service.tier.disk_tier import DiskTier, TierIdentity

if TYPE_CHECKING:
    # Imported where the tiers open (MemoryCore.open_tiers): they copy blocks with torch, seconds of
    # CPU to import, which a service without a tier (the CPU pool is bytes to it) never needs.
    from memory_service.tier.worker import TierWorker

log = get_logger("memory_service")

# A single Step may not carry more ops than this (a guard against absurd requests).
MAX_OPS_PER_STEP = 65536
# KeepAlive streams one client may hold at once: one, plus room for a reopened stream while the
# server has not yet noticed that the old one ended. More is a client bug or an attack.
MAX_STREAMS_PER_CLIENT = 4
# Longest model fingerprint an Attach may carry.
MAX_FINGERPRINT_LENGTH = 128
# Accepted KeepAlive heartbeat intervals (0 = the server's default, lease_ttl_s / 3).
MIN_KEEPALIVE_INTERVAL_S, MAX_KEEPALIVE_INTERVAL_S = 0.05, 3600.0


def _create_pool_now(layout: KvLayout, num_blocks: int, device: str, delay_s: float) -> KvPool:
    """``create_pool``, in the worker thread; then the test-only delay, once the segment exists, as
    if allocating and mapping it took that long (``MemoryManagerServicer``'s pool_creation_delay_s)."""
    pool = create_pool(layout, num_blocks, device)
    if delay_s > 0:
        time.sleep(delay_s)
    return pool


@dataclass
class Lease:
    name: str
    last_seen: float
    num_streams: int = 0  # open KeepAlive streams; a lease with one never expires by time
    is_trusted: bool = True  # presented the service's token at Attach (or the service has none)


class MemoryManagerServicer(memory_pb2_grpc.MemoryManagerServicer):
    """Owns the KV pool (created at the first attach), the block manager and the leases.

    Args:
        config: the service's configuration.
        pool_creation_delay_s: test only (pagedserve/test_hooks.py): seconds the pool's creation
            takes at least, so that the tests of what happens meanwhile (calls answered, an Attach
            that gives up, a SIGTERM) do not depend on how fast this machine allocates pages.
    """

    def __init__(self, config: MemoryServiceConfig, *, pool_creation_delay_s: float = 0.0) -> None:
        self.config = config
        self._pool_creation_delay_s = pool_creation_delay_s
        self._leases: dict[str, Lease] = {}
        self.layout: KvLayout | None = None
        self.pool: KvPool | None = None
        self.core: MemoryCore | None = None  # made with the pool, at the first attach
        self._stopping = asyncio.Event()
        self.is_draining = False  # SIGTERM: no new attach (service/server.py, drain)
        self._reaper: asyncio.Task | None = None
        self._pool_lock = asyncio.Lock()  # one first attach creates the pool; the others wait for it
        self._creating: asyncio.Task | None = None  # the pool's creation (see _ensure_pool)
        self._disk: DiskTier | None = None
        self._tier_lock = asyncio.Lock()
        # Told of every block committed, evicted, stored in or dropped from a tier (kv_events.py).
        self.kv_events = KvEventLog(config.block_size) if config.kv_events_endpoint is not None else None
        self.traces: StepTraces | None = None  # set before serving when traces are on (service/server.py)
        if config.kv_host_bytes is not None:  # allocated at the first trusted Attach: refused now if it cannot be
            check_host_tier_space(config.kv_host_bytes)
        if config.kv_disk_dir is not None:  # made (0700) now: a bad directory fails the start
            self._disk = DiskTier(config.kv_disk_dir, config.kv_disk_bytes or DEFAULT_KV_DISK_BYTES)
        # Told to every client at Attach (memory_service/identity.py); kept in the tier's directory,
        # which is what outlives a restart.
        self.service_id = service_id(config.kv_disk_dir)
        self.epoch = new_epoch()  # new at every start: the pool starts empty
        tiers = []  # fastest first
        if config.kv_host_bytes is not None:
            tiers.append(KvTierInfo("host", config.kv_host_bytes))
        if self._disk is not None:
            tiers.append(KvTierInfo("disk", self._disk.capacity_bytes))
        self.tiers: tuple[KvTierInfo, ...] = tuple(tiers)

    @property
    def block_manager(self) -> BlockManager | None:
        """The core's block manager (None before the pool exists)."""
        return self.core.block_manager if self.core is not None else None

    @property
    def tier(self) -> TierWorker | None:
        """The tiers' worker, once the tiers are open (the module docstring)."""
        return self.core.tier if self.core is not None else None

    def start(self) -> None:
        """Starts the lease reaper; call on the server's event loop."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap_expired_leases())

    # --- pool -------------------------------------------------------------------------------

    def _num_blocks_for(self, layout: KvLayout) -> int:
        cfg = self.config
        if cfg.max_num_blocks is not None:
            return cfg.max_num_blocks
        budget = cfg.kv_cache_bytes
        if budget is None:
            budget, sources = default_kv_budget(cfg.device, cfg.memory_utilization_threshold)
            log.info("kv_pool_sized", num_bytes=budget, device=cfg.device, **sources)
        num_blocks = budget // layout.bytes_per_block
        if num_blocks < 1:
            raise PreconditionError(
                f"a KV budget of {budget} bytes holds no block of {layout.bytes_per_block} bytes for this layout"
            )
        if num_blocks > MAX_NUM_BLOCKS:
            # Each block costs the service ~100 bytes of metadata whatever its size: a tiny layout
            # must not turn a byte budget into millions of block records.
            log.warning("num_blocks_capped", num_blocks=num_blocks, max_num_blocks=MAX_NUM_BLOCKS)
            num_blocks = MAX_NUM_BLOCKS
        return num_blocks

    async def _ensure_pool(self, layout: KvLayout) -> None:
        async with self._pool_lock:
            if self._stopping.is_set():
                raise UnavailableError("the memory service is shutting down")
            if self.pool is None:
                # A task of its own, shielded: an Attach cancelled mid-creation (its client gave up,
                # or the server stops) releases the lock but not the creation. The next Attach waits
                # for that same task (a second one would replace the pool and leak its segment), and
                # ``close`` waits for it too.
                if self._creating is None or self._creating.done():  # none yet, or the last one failed
                    self._creating = asyncio.ensure_future(self._create_pool(layout))
                await asyncio.shield(self._creating)
                if self._stopping.is_set():
                    raise UnavailableError("the memory service is shutting down")
            if layout != self.layout:
                raise PreconditionError(f"layout {layout} does not fit the existing pool's layout {self.layout}")

    async def _create_pool(self, layout: KvLayout) -> None:
        if layout.block_size != self.config.block_size:
            raise PreconditionError(
                f"layout.block_size {layout.block_size} differs from the service's block_size {self.config.block_size}"
            )
        num_blocks = self._num_blocks_for(layout)
        if self.config.device == "cpu":
            check_shm_space(layout.bytes_per_block * num_blocks)
        reserved = int(num_blocks * self.config.reserved_fraction)
        bm_config = BlockManagerConfig(
            num_blocks=num_blocks,
            block_size=layout.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            reserved_blocks=reserved,
            reserved_min_priority=self.config.reserved_min_priority,
        )
        # A CPU pool is allocated and mapped in full (seconds a GiB): in a worker thread, so that
        # health checks and every other call are answered meanwhile, not after the event loop is free.
        self.pool = await asyncio.to_thread(_create_pool_now, layout, num_blocks, self.config.device,
                                             self._pool_creation_delay_s)
        self.layout = layout
        self.core = MemoryCore(bm_config, self.pool.copy_block, kv_events=self.kv_events)
        log.info(
            "pool_created",
            num_blocks=num_blocks,
            reserved_blocks=reserved,
            num_bytes=self.pool.descriptor().num_bytes,
            layout=str(layout),
        )

    # --- leases -----------------------------------------------------------------------------

    def _lease(self, client_id: str, context: grpc.aio.ServicerContext) -> Lease:
        lease = self._leases.get(client_id)
        if lease is None:
            raise PreconditionError(
                f"client_id {echo(client_id)} is not attached (never attached, detached, or its lease expired): "
                "attach again"
            )
        if lease.is_trusted and not self._is_trusted_call(context):
            # A trusted client's id is no credential: whoever names it must hold the token too.
            raise UnauthenticatedError(f"client_id {echo(client_id)} attached with the service token: "
                                       "every call naming it must carry it")
        lease.last_seen = time.monotonic()
        return lease

    def _is_trusted_call(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the call carries the service's token (every call does when there is none)."""
        token = self.config.auth_token
        return token is None or trust.is_trusted(token, bearer_token(context.invocation_metadata()))

    def _release(self, client_id: str, reason: str) -> int:
        lease = self._leases.pop(client_id, None)
        if lease is None or self.core is None:
            return 0
        num_freed = self.core.release_client(client_id)
        log.info("client_released", client_id=client_id, client_name=lease.name, reason=reason, num_freed=num_freed)
        return num_freed

    async def _reap_expired_leases(self) -> None:
        ttl = self.config.lease_ttl_s
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=min(1.0, ttl / 4))
            except TimeoutError:
                pass
            now = time.monotonic()
            expired = [c for c, lease in self._leases.items() if lease.num_streams == 0 and now - lease.last_seen > ttl]
            for client_id in expired:
                self._release(client_id, "lease_expired")

    # --- RPCs -------------------------------------------------------------------------------

    @property
    def num_busy_clients(self) -> int:
        """Clients a drain waits for: attached, holding a KeepAlive stream open (alive: a compute
        service holds one for its life), and holding sequences (requests in flight). An idle client is
        not waited for (it detaches only when it stops itself), nor one that died (its stream is gone)."""
        return sum(1 for client_id, lease in self._leases.items()
                   if lease.num_streams and self.core.num_sequences_of(client_id))

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        if self.is_draining:
            raise UnavailableError("the memory service is shutting down: attach to another one, or again after it "
                                   "restarts")
        layout = convert.layout_from_pb(request.layout, self.config.block_size)
        if len(request.client_name) > 128:
            raise InvalidArgument(f"client_name has {len(request.client_name)} characters, at most 128")
        if len(request.model_fingerprint) > MAX_FINGERPRINT_LENGTH:
            raise InvalidArgument(f"model_fingerprint has {len(request.model_fingerprint)} characters, "
                                  f"at most {MAX_FINGERPRINT_LENGTH}")
        await self._ensure_pool(layout)
        is_trusted = self._is_trusted_call(context)
        tier_identity = await self._tier_identity(request.model_fingerprint, is_trusted)
        # After the await, with no other until the lease is added: attaches that waited for the pool
        # together cannot all pass the check.
        if len(self._leases) >= self.config.max_clients:
            raise ResourceExhaustedError(f"{len(self._leases)} clients are attached, the most this service takes")
        client_id = f"{request.client_name or 'client'}-{secrets.token_hex(6)}"
        bm_config = self.core.config
        # Built before the client is added: a reply that cannot be built must not leave a lease behind.
        reply = pb.AttachResponse(
            client_id=client_id,
            pool=convert.descriptor_to_pb(self.pool.descriptor()),
            num_blocks=bm_config.num_blocks,
            block_size=bm_config.block_size,
            lease_ttl_s=self.config.lease_ttl_s,
            num_reserved_blocks=bm_config.reserved_blocks,
            reserved_min_priority=bm_config.reserved_min_priority,
            memory_service_id=self.service_id,
            tiers=convert.tiers_to_pb(self.tiers),
            memory_service_epoch=self.epoch,
        )
        max_blocks = self.config.max_blocks_per_client if is_trusted else self.config.max_untrusted_client_blocks
        self.core.add_client(client_id, max_blocks, tier_identity)
        self._leases[client_id] = Lease(name=request.client_name, last_seen=time.monotonic(), is_trusted=is_trusted)
        log.info("client_attached", client_id=client_id, is_trusted=is_trusted, max_blocks=max_blocks,
                 uses_tier=tier_identity is not None)
        return reply

    async def _tier_identity(self, fingerprint: str, is_trusted: bool) -> bytes | None:
        """The tier identity of a client about to attach (None: it does not use the tier); opens the
        tier on the first one that may use it (the module docstring)."""
        if not self.tiers or not fingerprint or not is_trusted:
            return None
        async with self._tier_lock:
            if self.core.tier_identity is None:
                layout = self.layout
                identity = TierIdentity(fingerprint, layout.dtype, layout.block_size, layout.num_layers,
                                        layout.num_kv_heads, layout.head_dim)
                await asyncio.to_thread(self._open_tiers, identity)
        identity = self.core.tier_identity
        if identity.fingerprint != fingerprint:
            log.warning("kv_tier_not_for_this_model", reason="the tier keeps another model's blocks: "
                        "this client does not use it", tier_fingerprint=identity.fingerprint, fingerprint=fingerprint)
            return None
        return identity.digest

    def _open_tiers(self, identity: TierIdentity) -> None:
        """Opens the tiers for ``identity`` and starts their threads (in a worker thread: see
        ``MemoryCore.open_tiers``)."""
        import torch

        # The tier's block copies on one thread: torch's default, a thread per core whose OpenMP
        # workers spin after each copy, takes CPU from the compute services beside this service (the
        # host's cores are theirs).
        torch.set_num_threads(1)
        pool = self.pool
        if pool is None:  # closed meanwhile
            raise UnavailableError("the memory service is shutting down")
        on_load_done = self.traces.load_done if self.traces is not None else None
        self.core.open_tiers(identity, pool.tensor, host_bytes=self.config.kv_host_bytes, disk=self._disk,
                             on_load_done=on_load_done)

    async def Detach(self, request: pb.DetachRequest, context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        self._lease(request.client_id, context)
        return pb.DetachResponse(num_freed_sequences=self._release(request.client_id, "detach"))

    async def KeepAlive(
        self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KeepAliveResponse]:
        interval = request.interval_s
        if interval == 0:
            interval = max(MIN_KEEPALIVE_INTERVAL_S, self.config.lease_ttl_s / 3)
        elif not (math.isfinite(interval) and MIN_KEEPALIVE_INTERVAL_S <= interval <= MAX_KEEPALIVE_INTERVAL_S):
            raise InvalidArgument(
                f"interval_s must be 0 (the default) or in [{MIN_KEEPALIVE_INTERVAL_S}, {MAX_KEEPALIVE_INTERVAL_S}], "
                f"got {interval}"
            )
        lease = self._lease(request.client_id, context)
        if lease.num_streams >= MAX_STREAMS_PER_CLIENT:
            raise ResourceExhaustedError(
                f"client_id {echo(request.client_id)} already holds {lease.num_streams} KeepAlive streams")
        lease.num_streams += 1
        try:
            # Ends when the lease does (detach) or the server stops; a client that goes away
            # cancels this coroutine at its await.
            while self._leases.get(request.client_id) is lease and not self._stopping.is_set():
                yield pb.KeepAliveResponse(server_time=time.time())
                try:
                    await asyncio.wait_for(self._stopping.wait(), timeout=interval)
                except TimeoutError:
                    pass
        finally:
            lease.num_streams -= 1
            lease.last_seen = time.monotonic()  # the TTL runs from here (see the module docstring)

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        num_ops = len(request.ops) + len(request.appends.seq_ids) + len(request.late_ops)
        if self.traces is None:
            return self._step(request, context, num_ops, None)
        with self.traces.step(context.invocation_metadata(), request.client_id, num_ops) as trace:
            return self._step(request, context, num_ops, trace)

    def _step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext, num_ops: int,
              trace: StepTrace | None) -> pb.StepResponse:
        if num_ops > MAX_OPS_PER_STEP:
            raise InvalidArgument(f"the step has {num_ops} ops; at most {MAX_OPS_PER_STEP} per step")
        lease = self._lease(request.client_id, context)
        early = [convert.op_from_pb(op) for op in request.ops]
        appends = convert.appends_from_pb(request.appends)
        late = [convert.op_from_pb(op) for op in request.late_ops]
        if not lease.is_trusted:  # before anything applies: a refused namespace changes nothing
            early = trust.confine(request.client_id, early)
            late = trust.confine(request.client_id, late, "late_ops")
        # One step so that validation covers the whole batch before anything changes.
        step = self.core.step(request.client_id, [*early, *appends, *late], request.prefill_tokens_per_s,
                              on_new_loads=trace.started_loads if trace is not None else None)
        results = step.results
        num_early = len(early)
        return pb.StepResponse(
            results=[convert.result_to_pb(r) for r in results[:num_early] + results[num_early + len(appends) :]],
            append_results=convert.append_results_to_pb(results[num_early : num_early + len(appends)]),
            num_available_blocks=step.num_available_blocks,
            num_available_reserved_blocks=step.num_available_reserved_blocks,
            loaded_seq_ids=step.loaded_seq_ids,
        )

    async def GetBlockTable(
        self, request: pb.GetBlockTableRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetBlockTableResponse:
        self._lease(request.client_id, context)
        return pb.GetBlockTableResponse(block_ids=self.core.block_table(request.client_id, request.seq_id))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return convert.stats_to_pb(self.stats())

    async def Ping(self, request: pb.PingRequest, context: grpc.aio.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse()

    async def CheckIntegrity(
        self, request: pb.CheckIntegrityRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckIntegrityResponse:
        problem = self.check_integrity()
        return pb.CheckIntegrityResponse(ok=problem is None, problem=problem or "")

    # --- for the server and the metrics -----------------------------------------------------

    def stats(self) -> BlockManagerStats:
        """A snapshot of blocks, cache and clients; safe to call from any thread."""
        core = self.core
        if core is None:  # before the first attach there is no pool
            return BlockManagerStats.empty(self.config.block_size, num_clients=len(self._leases))
        return core.stats()

    def load_latency(self) -> dict[str, tuple[list[tuple[float, int]], float]]:
        """The tiers' load latency histograms (``TierWorker.load_latency``), empty without a tier."""
        core = self.core
        return core.load_latency() if core is not None else {}

    def check_integrity(self) -> str | None:
        """None when every block-manager invariant holds, else the first broken one (logged as an error)."""
        if self.core is None:
            return None
        problem = self.core.check_integrity()
        if problem is not None:  # a bug of this service: reported to the caller, not hidden
            log.error("integrity_check_failed", problem=problem)
        return problem

    async def close(self) -> None:
        """Ends the streams and the reaper, and frees the pool (the shared-memory name is unlinked)."""
        self._stopping.set()
        if self._reaper is not None:
            await self._reaper
        if self._creating is not None:
            with contextlib.suppress(Exception):  # its Attach reports a failure; here only the pool matters
                await self._creating
        if self.core is not None:  # before the pool goes: the tiers' threads read and write it
            await asyncio.to_thread(self.core.close_tiers)  # and a tier opening from now on starts nothing
        with self.core.lock if self.core is not None else contextlib.nullcontext():
            if self.pool is not None:
                self.pool.close()
                self.pool = None
