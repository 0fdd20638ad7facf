"""Real processes for the end-to-end tests: engine pairs (memory + compute service, as one engine
pod runs them) with a tiny random-weight model, and gateways in front, all started with
``python -m`` through ServiceProcess, talked to over their sockets, stopped by PID.

Starting processes is the expensive part on a 2-core machine, so the two engines and the main
gateway are shared by the whole session; tests that need a gateway configured otherwise (auth,
a small queue) start only that gateway.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.process import ServiceProcess
from tests.compute_service.service_fixtures import ServiceModel, build_service_model

GATEWAY_SERVICE = "pagedserve.gateway.v1.Gateway"
COMPUTE_SERVICE = "pagedserve.compute.v1.Compute"
MEMORY_SERVICE = "pagedserve.memory.v1.MemoryManager"
BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def shm_segments(pid: int) -> list[str]:
    """The shared-memory KV pool segments of the memory service with this process id."""
    return [p.name for p in Path("/dev/shm").glob(f"pagedserve-kv-{pid}-*")]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Engine:
    """One engine pod: a memory service and the compute service attached to it."""

    name: str
    memory: ServiceProcess
    compute: ServiceProcess
    compute_args: list[str]
    log_dir: Path

    @property
    def address(self) -> str:
        return self.compute.address

    def load(self) -> compute_pb2.LoadResponse:
        with grpc.insecure_channel(self.compute.address) as channel:
            return compute_pb2_grpc.ComputeStub(channel).Load(compute_pb2.LoadRequest(), timeout=5)

    def memory_stats(self) -> memory_pb2.StatsResponse:
        with grpc.insecure_channel(self.memory.address) as channel:
            return memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=5)

    def num_used_blocks(self) -> int:
        return sum(pool.num_used_blocks for pool in self.memory_stats().pools)

    def restart_compute(self) -> None:
        """A new compute process on the same socket, attached to the same memory service."""
        self.compute = ServiceProcess.launch("compute_service", self.compute_args, address=self.compute.address,
                                             health_service=COMPUTE_SERVICE, ready_timeout_s=120,
                                             log_file=self.log_dir / f"{self.name}-compute-2.log")


@dataclass
class Gateway:
    """A gateway process and a stub on its address."""

    process: ServiceProcess
    metrics_port: int
    log_file: Path
    channel: grpc.Channel = field(init=False)
    stub: gateway_pb2_grpc.GatewayStub = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.process.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    @property
    def address(self) -> str:
        return self.process.address

    def num_healthy_backends(self) -> int:
        models = self.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5).models
        return models[0].num_healthy_backends if models else 0

    def stop(self) -> int:
        self.channel.close()
        return self.process.stop()


def start_engines(model_dir: Path, run_dir: Path, names: list[str]) -> list[Engine]:
    """Engine pods, started in parallel (their model loads overlap)."""
    memories = [ServiceProcess("memory_service", ["--socket", run_dir / f"{n}-memory.sock", "--max-num-blocks", "256",
                                                  "--block-size", str(BLOCK_SIZE), "--log-level", "warning"],
                               address=f"unix:{run_dir / f'{n}-memory.sock'}", health_service=MEMORY_SERVICE,
                               log_file=run_dir / f"{n}-memory.log") for n in names]
    for memory in memories:
        memory.wait_ready(60)
    engines = []
    for name, memory in zip(names, memories):
        args = ["--memory-socket", str(run_dir / f"{name}-memory.sock"), "--model", str(model_dir),
                "--listen", f"unix:{run_dir / f'{name}-compute.sock'}", "--block-size", str(BLOCK_SIZE),
                "--max-num-seqs", "16"]
        compute = ServiceProcess("compute_service", args, address=f"unix:{run_dir / f'{name}-compute.sock'}",
                                 health_service=COMPUTE_SERVICE, log_file=run_dir / f"{name}-compute.log")
        engines.append(Engine(name, memory, compute, args, run_dir))
    for engine in engines:
        engine.compute.wait_ready(120)
    return engines


def start_gateway(backends: list[str], log_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Gateway:
    """A gateway on a free port, ready (tokenizer fetched, a backend in rotation)."""
    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    log_file = log_dir / f"gateway-{address.rsplit(':', 1)[1]}.log"
    args = [a for b in backends for a in ("--backend", b)]
    args += ["--listen", address, "--metrics-port", str(metrics_port), "--health-interval-s", "0.2",
             "--grace-period-s", "10", *extra]
    process = ServiceProcess.launch("gateway", args, address=address, health_service=GATEWAY_SERVICE,
                                    ready_timeout_s=60, log_file=log_file, env=env)
    return Gateway(process, metrics_port, log_file)


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory) -> ServiceModel:
    """The tiny random Llama with a byte-level tokenizer (the compute service tests' model)."""
    return build_service_model(tmp_path_factory.mktemp("e2e-model"))


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("e2e-run")
    os.chmod(directory, 0o700)
    return directory


@pytest.fixture(scope="session")
def engines(service_model: ServiceModel, run_dir: Path) -> Iterator[list[Engine]]:
    """Two engine pods, each with its own memory service (so each has its own prefix cache)."""
    started = start_engines(service_model.path, run_dir, ["a", "b"])
    yield started
    for engine in started:
        engine.compute.stop()
        assert engine.memory.stop() == 0
        assert not shm_segments(engine.memory.pid), "a memory service left its shared memory behind"
    assert not list(run_dir.glob("*.sock")), "a service left its socket behind"


@pytest.fixture(scope="session")
def gateway(engines: list[Engine], run_dir: Path) -> Iterator[Gateway]:
    """The main gateway, in front of both engines."""
    started = start_gateway([e.address for e in engines], run_dir)
    wait_until(lambda: started.num_healthy_backends() == 2, what="both backends in rotation")
    yield started
    assert started.stop() == 0
