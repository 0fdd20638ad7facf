"""One whole stack for the reliability scenarios: a memory service, a compute service attached to it
and a gateway in front, all real processes started by ``pagedserve.stack``, plus the checks every
scenario ends with: every block accounted for, nothing leaked (sequences, /dev/shm segments,
sockets), and the descriptor and thread counts of each process.

``benchmarks/bench_reliability.py`` runs it with the default model and big numbers; the
``tests/reliability`` suite runs the same code with the tiny byte-tokenizer model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from pagedserve import stack as launcher
from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.process import ServiceProcess, check_health, wait_until
from pagedserve.sockets import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Short lease and fast re-attach: a crashed compute service's blocks come back within ~2 s.
LEASE_TTL_S = 2.0


@dataclass
class Gateway:
    """A gateway process, a stub on its address and its metrics port."""

    process: ServiceProcess
    metrics_port: int
    channel: grpc.Channel = field(init=False)
    stub: gateway_pb2_grpc.GatewayStub = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.process.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def log_file(self) -> Path | None:
        return self.process.log_file

    def num_healthy_backends(self) -> int:
        models = self.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5).models
        return models[0].num_healthy_backends if models else 0

    def stop(self) -> int:
        self.channel.close()
        return self.process.stop()


def gateway_args(metrics_port: int, *extra: str) -> tuple[str, ...]:
    """The test and benchmark gateways' flags: a fast health check, a bounded drain."""
    return ("--metrics-port", str(metrics_port), "--health-interval-s", "0.2", "--grace-period-s", "10", *extra)


def start_gateway(backends: list[str], log_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Gateway:
    """A gateway on a free port, ready (tokenizer fetched, a backend in rotation)."""
    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    log_file = log_dir / f"gateway-{address.rsplit(':', 1)[1]}.log"
    process = launcher.gateway_process(backends, address, gateway_args(metrics_port, *extra), log_file=log_file,
                                       env=env)
    return Gateway(launcher.ready(process, 60), metrics_port)


def memory_stats(address: str) -> memory_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=5)


def compute_load(address: str) -> compute_pb2.LoadResponse:
    with grpc.insecure_channel(address) as channel:
        return compute_pb2_grpc.ComputeStub(channel).Load(compute_pb2.LoadRequest(), timeout=5)


@dataclass(frozen=True)
class StackConfig:
    """Sizes of one stack (the tests' defaults: the tiny model, few blocks, a short queue)."""

    model: str
    block_size: int = 16
    max_num_blocks: int = 256
    max_num_seqs: int = 16
    compute_max_queued: int = 64
    gateway_max_queued: int = 64
    gateway_args: tuple[str, ...] = ()
    # float32, not the compute service's "auto": tests compare tokens with transformers' float32
    dtype: str = "float32"

    def stack_config(self, metrics_port: int) -> launcher.StackConfig:
        memory = ("--max-num-blocks", str(self.max_num_blocks), "--block-size", str(self.block_size),
                  "--lease-ttl-s", str(LEASE_TTL_S))
        compute = ("--dtype", self.dtype, "--block-size", str(self.block_size), "--max-num-seqs",
                   str(self.max_num_seqs),
                   "--max-queued-requests", str(self.compute_max_queued),
                   "--memory-retry-interval-s", "0.2", "--memory-ping-interval-s", "0.2")
        gateway = gateway_args(metrics_port, "--max-queued-requests", str(self.gateway_max_queued), *self.gateway_args)
        return launcher.StackConfig(model=self.model, memory_args=memory, compute_args=compute, gateway_args=gateway,
                                    ready_timeout_s=300)


class EngineServices:
    """The memory and compute processes of a started ``pagedserve.stack.Stack`` (``self.services``)
    and what every scenario asks of them: shared by the reliability stack and the e2e engine pairs."""

    services: launcher.Stack

    @property
    def memory(self) -> ServiceProcess:
        assert self.services.memory is not None
        return self.services.memory

    @property
    def compute(self) -> ServiceProcess:
        assert self.services.compute is not None
        return self.services.compute

    def memory_stats(self) -> memory_pb2.StatsResponse:
        return memory_stats(self.memory.address)

    def compute_load(self) -> compute_pb2.LoadResponse:
        return compute_load(self.compute.address)

    def num_used_blocks(self) -> int:
        return used_blocks(self.memory_stats())


@dataclass
class Stack(EngineServices):
    """A running memory + compute + gateway (``pagedserve.stack.Stack``) and a client of each."""

    config: StackConfig
    services: launcher.Stack
    gateway: Gateway

    @property
    def run_dir(self) -> Path:
        return self.services.directory

    def compute_health(self) -> int | None:
        return check_health(self.compute.address, launcher.COMPUTE_SERVICE)

    def restart_memory(self) -> None:
        """A new memory service on the same socket (after a kill); the compute service re-attaches."""
        self.services.restart_memory()

    def restart_compute(self) -> None:
        """A new compute service on the same socket (after a kill), attached to the same memory service."""
        self.services.restart_compute()

    def wait_idle(self, timeout_s: float = 10.0) -> memory_pb2.StatsResponse:
        """Waits until no sequence holds a block, then checks that every block is accounted for."""
        wait_until(lambda: self.memory_stats().num_sequences == 0 and self.num_used_blocks() == 0,
                   timeout_s, "every sequence freed and no block in use")
        stats = self.memory_stats()
        check_accounting(stats)
        check_integrity(self.memory.address)
        return stats

    def pids(self) -> dict[str, int]:
        return {"memory": self.memory.pid, "compute": self.compute.pid, "gateway": self.gateway.process.pid}

    def resources(self) -> dict[str, dict[str, int]]:
        """Open descriptors and threads of each process now."""
        return {name: process_resources(pid) for name, pid in self.pids().items()}

    def all_serving(self) -> bool:
        return (check_health(self.memory.address, launcher.MEMORY_SERVICE) == SERVING
                and self.compute_health() == SERVING
                and check_health(self.gateway.address, "") == SERVING)

    def stop(self) -> dict[str, int]:
        """Stops gateway, compute, memory by PID; checks nothing is left; returns the exit statuses."""
        self.gateway.channel.close()
        by_module = self.services.stop()
        statuses = {"gateway": by_module["gateway"], "compute": by_module["compute_service"],
                    "memory": by_module["memory_service"]}
        for pid in [*self.services.old_memory_pids, self.memory.pid]:
            assert not launcher.shm_segments(pid), f"memory service {pid} left {launcher.shm_segments(pid)} in /dev/shm"
        assert not list(self.run_dir.glob("*.sock")), "a service left its socket behind"
        return statuses


def warm_up(gateway: Gateway, timeout_s: float = 300.0) -> None:
    """One request, with all the time it needs: a fresh compute service's first step may load the
    fused CPU kernels (seconds on a busy machine), which no scenario is about."""
    gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt="warm up", params=gateway_pb2.SamplingParams(
        max_tokens=1)), timeout=timeout_s)


def used_blocks(stats: memory_pb2.StatsResponse) -> int:
    return sum(pool.num_used_blocks for pool in stats.pools)


def check_accounting(stats: memory_pb2.StatsResponse) -> None:
    """Every block of every pool is free, cached or in use, exactly once."""
    for pool in stats.pools:
        parts = pool.num_free_blocks + pool.num_cached_blocks + pool.num_used_blocks
        assert parts == pool.num_total_blocks, (
            f"pool {pool.name!r}: {parts} blocks accounted of {pool.num_total_blocks}")


def check_integrity(memory_address: str) -> None:
    """The memory service's own integrity check (every invariant of its block manager) holds."""
    with grpc.insecure_channel(memory_address) as channel:
        stub = memory_pb2_grpc.MemoryManagerStub(channel)
        reply = stub.CheckIntegrity(memory_pb2.CheckIntegrityRequest(), timeout=30)
    assert reply.ok, f"memory service integrity check failed: {reply.problem}"


def kv_layout(model: str, block_size: int, dtype: str = "float32") -> memory_pb2.KvLayout:
    """The KV layout a compute service serving ``model`` attaches with (CPU: float32)."""
    from compute_service.model.model_config import ModelConfig
    from compute_service.model.model_loader import resolve_model

    config = ModelConfig.from_dir(resolve_model(model).path, name=model)
    return memory_pb2.KvLayout(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                               head_dim=config.head_dim, dtype=dtype, block_size=block_size)


def process_resources(pid: int) -> dict[str, int]:
    """Open file descriptors and threads of a live process (Linux /proc)."""
    num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text()
    num_threads = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
    return {"fds": num_fds, "threads": num_threads}


def start_stack(config: StackConfig, run_dir: Path) -> Stack:
    """Starts memory, compute and gateway in ``run_dir`` (made 0700) and waits until all serve and
    the gateway has its backend in rotation and has answered once."""
    metrics_port = free_port()
    services = launcher.start_stack(config.stack_config(metrics_port), run_dir)
    assert services.gateway is not None
    stack = Stack(config, services, Gateway(services.gateway, metrics_port))
    try:
        wait_until(lambda: stack.gateway.num_healthy_backends() == 1, 30, "the backend in rotation")
        warm_up(stack.gateway)
    except BaseException:
        stack.stop()
        raise
    return stack
