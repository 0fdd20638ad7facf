"""Start the memory service: gRPC over a Unix socket (TCP only when asked), health, reflection, metrics."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from pagedserve import rpc
from pagedserve.log import get_logger
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc

from memory_service.config import MemoryServiceConfig
from memory_service.metrics import MemoryStatsCollector
from memory_service.servicer import MemoryManagerServicer

log = get_logger("memory_service")

SERVICE_NAME = memory_pb2.DESCRIPTOR.services_by_name["MemoryManager"].full_name


@dataclass
class RunningMemoryService:
    server: grpc.Server
    servicer: MemoryManagerServicer
    addresses: list[str]

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()
        self.servicer.close()


def start(config: MemoryServiceConfig) -> RunningMemoryService:
    """Start serving; returns at once. The caller stops it with ``.stop()``."""
    servicer = MemoryManagerServicer(config)
    server, _health = rpc.create_server(
        [lambda s: memory_pb2_grpc.add_MemoryManagerServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    addresses = []
    socket = config.socket if config.socket is not None or config.address is not None else rpc.default_socket_path()
    if socket is not None:
        addresses.append(rpc.bind(server, f"unix:{socket}"))
    if config.address is not None:
        addresses.append(rpc.bind(server, config.address))
    server.start()
    for address in addresses:
        rpc.secure_socket(address)
    if config.metrics_port is not None:
        registry = CollectorRegistry()
        registry.register(MemoryStatsCollector(servicer))
        start_http_server(config.metrics_port, registry=registry)
    log.info("memory_service_started", addresses=addresses, metrics_port=config.metrics_port)
    return RunningMemoryService(server=server, servicer=servicer, addresses=addresses)
