"""Real processes for the end-to-end tests: engine pairs (memory + compute service, as one engine
pod runs them) with a tiny random-weight model, and gateways in front, all started with
``python -m`` through ServiceProcess, talked to over their sockets, stopped by PID.

Starting processes is the expensive part on a 2-core machine, so the two engines and the main
gateway are shared by the whole session; tests that need a gateway configured otherwise (auth,
a small queue) start only that gateway.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedserve.testing.stack import EngineServices, Gateway, start_gateway
from pagedserve.testing.tiny_model import ServiceModel
from pagedserve.compute.v1 import compute_pb2
from pagedserve.process import wait_until
from pagedserve.stack import Stack, StackConfig, shm_segments, start_stacks

BLOCK_SIZE = 16


@dataclass
class Engine(EngineServices):
    """One engine pod: a memory service and the compute service attached to it (a stack without gateway)."""

    name: str
    services: Stack

    @property
    def address(self) -> str:
        return self.compute.address

    def load(self) -> compute_pb2.LoadResponse:
        return self.compute_load()

    def restart_compute(self) -> None:
        """A new compute process on the same socket, attached to the same memory service."""
        self.services.restart_compute()


def start_engines(model_dir: Path, run_dir: Path, names: list[str]) -> list[Engine]:
    """Engine pods, started side by side (their model loads overlap)."""
    configs = [StackConfig(model=str(model_dir), name=f"{n}-", ready_timeout_s=120,
                           memory_args=("--max-num-blocks", "256", "--block-size", str(BLOCK_SIZE), "--log-level",
                                        "warning"),
                           compute_args=("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-num-seqs",
                                         "16")) for n in names]
    stacks = start_stacks([Stack(c, run_dir) for c in configs], with_gateway=False)
    return [Engine(name, stack) for name, stack in zip(names, stacks)]


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
        assert engine.services.stop()["memory_service"] == 0
        assert not shm_segments(engine.memory.pid), "a memory service left its shared memory behind"
    assert not list(run_dir.glob("*.sock")), "a service left its socket behind"


@pytest.fixture(scope="session")
def gateway(engines: list[Engine], run_dir: Path) -> Iterator[Gateway]:
    """The main gateway, in front of both engines."""
    started = start_gateway([e.address for e in engines], run_dir)
    wait_until(lambda: started.num_healthy_backends() == 2, what="both backends in rotation")
    yield started
    assert started.stop() == 0
