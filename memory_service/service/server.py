"""Start the memory service: grpc.aio over a Unix socket (TCP only when asked), health, reflection, metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from pagedserve import rpc, sockets
from pagedserve.log import get_logger
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.trace_context import tracer_for

from memory_service.config import MemoryServiceConfig
from memory_service.service.metrics import MemoryStatsCollector
from memory_service.pool.kv_pool import remove_stale_segments
from memory_service.service.servicer import MemoryManagerServicer

if TYPE_CHECKING:
    from pagedserve.tracing import Tracer

    from memory_service.service.kv_events import KvEventPublisher

log = get_logger("memory_service")

SERVICE_NAME = memory_pb2.DESCRIPTOR.services_by_name["MemoryManager"].full_name


@dataclass
class RunningMemoryService:
    server: grpc.aio.Server
    servicer: MemoryManagerServicer
    addresses: list[str]
    health: rpc.AioHealth
    kv_events: KvEventPublisher | None = None
    tracer: Tracer | None = None

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM's first part: NOT_SERVING at once (readiness fails first), new attaches refused
        UNAVAILABLE, and the attached clients (compute services, which drain their own requests
        meanwhile) get up to ``timeout_s`` to finish the requests they hold blocks for; their Steps and
        KeepAlive streams are answered until then (``MemoryManagerServicer.num_busy_clients``: who is
        waited for)."""
        self.servicer.is_draining = True
        await self.health.shut_down()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        log.info("memory_service_draining", num_clients=self.servicer.num_busy_clients, timeout_s=timeout_s)
        while self.servicer.num_busy_clients and loop.time() < deadline:
            await asyncio.sleep(0.05)
        log.info("memory_service_drained", num_clients_left=self.servicer.num_busy_clients)

    async def stop(self, grace: float | None = 1.0) -> None:
        """NOT_SERVING, end the streams, stop the server, free the pool, send the last KV events and spans."""
        await self.health.shut_down()
        await self.servicer.close()  # ends KeepAlive streams, so the grace period is not spent on them
        await self.server.stop(grace)
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)


async def start(config: MemoryServiceConfig, *, pool_creation_delay_s: float = 0.0) -> RunningMemoryService:
    """Starts serving on the running event loop; returns at once. The caller stops it with ``await .stop()``.

    ``pool_creation_delay_s``: a test hook (pagedserve/test_hooks.py), see ``MemoryManagerServicer``.

    Raises:
        PreconditionError: the socket path is unsafe or a live service answers there, or the KV events'
            addresses cannot be opened.
    """
    num_removed = remove_stale_segments()
    if num_removed:
        log.info("stale_segments_removed", num_segments=num_removed)
    servicer = MemoryManagerServicer(config, pool_creation_delay_s=pool_creation_delay_s)
    tracer = tracer_for(config.otlp_traces_endpoint, "pagedserve-memory")  # None (nothing imported) when off
    if tracer is not None:
        from memory_service.service.step_traces import StepTraces

        servicer.traces = StepTraces(tracer)
    server, health = rpc.create_aio_server(
        [lambda s: memory_pb2_grpc.add_MemoryManagerServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    kv_events = None
    if servicer.kv_events is not None:  # before serving: an address that cannot be opened fails the start
        # Imported only then: pyzmq and msgpack cost a service without events nothing.
        from memory_service.service.kv_events import KvEventCollector, KvEventPublisher

        kv_events = KvEventPublisher(servicer.kv_events, config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                     config.kv_events_topic)
        kv_events.start()
    addresses = []
    socket = config.socket if config.socket is not None or config.address is not None else sockets.default_socket_path()
    if socket is not None:
        addresses.append(sockets.bind(server, f"unix:{socket}"))
    if config.address is not None:
        addresses.append(sockets.bind(server, config.address))
    with sockets.owner_only_umask():
        await server.start()
    for address in addresses:
        sockets.secure_socket(address)
    servicer.start()
    if config.metrics_port is not None:
        registry = CollectorRegistry()
        registry.register(MemoryStatsCollector(servicer.stats, servicer.load_latency))
        if kv_events is not None:
            registry.register(KvEventCollector(kv_events))
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=registry)
    log.info("memory_service_started", addresses=addresses, metrics_port=config.metrics_port,
             memory_service_id=servicer.service_id)
    return RunningMemoryService(server=server, servicer=servicer, addresses=addresses, health=health,
                                kv_events=kv_events, tracer=tracer)
