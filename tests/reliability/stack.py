"""One whole stack for the reliability scenarios: a memory service, a compute service attached to it
and a gateway in front, all real processes started through ServiceProcess (tests/e2e's Engine and
Gateway helpers), plus the checks every scenario ends with: every block accounted for, nothing
leaked (sequences, /dev/shm segments, sockets), and the descriptor and thread counts of each process.

The test suite runs it with the tiny byte-tokenizer model; ``benchmarks/bench_reliability.py`` runs
the same code with the default model and bigger numbers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.process import ServiceProcess, check_health
from tests.e2e.conftest import (
    COMPUTE_SERVICE, MEMORY_SERVICE, Engine, Gateway, shm_segments, start_gateway, wait_until,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Short lease and fast re-attach: a crashed compute service's blocks come back within ~2 s.
LEASE_TTL_S = 2.0


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


@dataclass
class Stack:
    """A running memory + compute + gateway; ``engine`` is tests/e2e's Engine (restart_compute etc.)."""

    config: StackConfig
    run_dir: Path
    engine: Engine
    gateway: Gateway
    memory_args: list[str] = field(default_factory=list)
    old_memory_pids: list[int] = field(default_factory=list)

    @property
    def memory(self) -> ServiceProcess:
        return self.engine.memory

    @property
    def compute(self) -> ServiceProcess:
        return self.engine.compute

    def memory_stats(self) -> memory_pb2.StatsResponse:
        return self.engine.memory_stats()

    def compute_health(self) -> int | None:
        return check_health(self.compute.address, COMPUTE_SERVICE)

    def restart_memory(self) -> None:
        """A new memory service on the same socket (after a kill); the compute service re-attaches."""
        self.old_memory_pids.append(self.memory.pid)
        self.engine.memory = _launch_memory(self.memory_args, self.memory.address, self.run_dir / "memory-2.log")

    def wait_idle(self, timeout_s: float = 10.0) -> memory_pb2.StatsResponse:
        """Waits until no sequence holds a block, then checks that every block is accounted for."""
        wait_until(lambda: self.memory_stats().num_sequences == 0 and used_blocks(self.memory_stats()) == 0,
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
        return (check_health(self.memory.address, MEMORY_SERVICE) == SERVING
                and self.compute_health() == SERVING
                and check_health(self.gateway.address, "") == SERVING)

    def stop(self) -> dict[str, int]:
        """Stops gateway, compute, memory by PID; checks nothing is left; returns the exit statuses."""
        statuses = {"gateway": self.gateway.stop(), "compute": self.compute.stop(), "memory": self.memory.stop()}
        for pid in [*self.old_memory_pids, self.memory.pid]:
            assert not shm_segments(pid), f"memory service {pid} left {shm_segments(pid)} in /dev/shm"
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
        assert parts == pool.num_total_blocks, f"pool {pool.name!r}: {parts} blocks accounted of {pool.num_total_blocks}"


def check_integrity(memory_address: str) -> None:
    """The memory service's own integrity check (every invariant of its block manager) holds."""
    with grpc.insecure_channel(memory_address) as channel:
        reply = memory_pb2_grpc.MemoryManagerStub(channel).CheckIntegrity(memory_pb2.CheckIntegrityRequest(), timeout=30)
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


def _launch_memory(args: Sequence[str], address: str, log_file: Path) -> ServiceProcess:
    return ServiceProcess.launch("memory_service", args, address=address, health_service=MEMORY_SERVICE,
                                 ready_timeout_s=60, log_file=log_file)


def start_stack(config: StackConfig, run_dir: Path, *gateway_extra: str) -> Stack:
    """Starts memory, compute and gateway in ``run_dir`` (mode 0700) and waits until all serve."""
    os.chmod(run_dir, 0o700)
    memory_socket = run_dir / "memory.sock"
    memory_args = ["--socket", str(memory_socket), "--max-num-blocks", str(config.max_num_blocks),
                   "--block-size", str(config.block_size), "--lease-ttl-s", str(LEASE_TTL_S)]
    memory = _launch_memory(memory_args, f"unix:{memory_socket}", run_dir / "memory.log")
    compute_address = f"unix:{run_dir / 'compute.sock'}"
    compute_args = ["--memory-socket", str(memory_socket), "--model", config.model, "--listen", compute_address,
                    "--block-size", str(config.block_size), "--max-num-seqs", str(config.max_num_seqs),
                    "--max-queued-requests", str(config.compute_max_queued),
                    "--memory-retry-interval-s", "0.2", "--memory-ping-interval-s", "0.2"]
    try:
        compute = ServiceProcess.launch("compute_service", compute_args, address=compute_address,
                                        health_service=COMPUTE_SERVICE, ready_timeout_s=300,
                                        log_file=run_dir / "compute.log")
    except BaseException:
        memory.stop()
        raise
    engine = Engine("r", memory, compute, compute_args, run_dir)
    try:
        gateway = start_gateway([compute_address], run_dir, "--max-queued-requests", str(config.gateway_max_queued),
                                *config.gateway_args, *gateway_extra)
        wait_until(lambda: gateway.num_healthy_backends() == 1, 30, "the backend in rotation")
        warm_up(gateway)
    except BaseException:
        compute.stop()
        memory.stop()
        raise
    return Stack(config, run_dir, engine, gateway, memory_args)

