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
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve_testing.stack import EngineServices, Gateway, start_gateway
from pagedserve_testing.tiny_model import ServiceModel
from pagedserve.compute.v1 import compute_pb2
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
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


_RUN_DIRS: list[Path] = []  # this worker's run directories, whose logs a failing test's report shows
_LOG_OFFSETS: dict[Path, int] = {}  # each log's size when the running test began


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("e2e-run")
    os.chmod(directory, 0o700)
    _RUN_DIRS.append(directory)
    return directory


def pytest_runtest_setup(item: pytest.Item) -> None:
    _LOG_OFFSETS.clear()
    for directory in _RUN_DIRS:
        for log_file in directory.glob("*.log"):
            _LOG_OFFSETS[log_file] = log_file.stat().st_size


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failing test's report carries what the services logged meanwhile above info (a 500's
    traceback is in a service's log, not in the client's exception): JSON lines of level warning or
    error, and every line that is not JSON (tracebacks, the standard library's format)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for directory in _RUN_DIRS:
        for log_file in sorted(directory.glob("*.log")):
            with log_file.open("rb") as f:
                f.seek(_LOG_OFFSETS.get(log_file, 0))
                text = f.read().decode(errors="replace")
            lines = [line for line in text.splitlines() if line.strip() and (
                not line.startswith("{") or '"level": "error"' in line or '"level": "warning"' in line)]
            if lines:
                report.sections.append((f"service log {log_file.name}", "\n".join(lines)[-8000:]))


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


# --- the HTTP front (test_openai*.py) ---


class Http:
    """A gateway process with its HTTP front."""

    def __init__(self, gateway: Gateway, http_port: int, key: str | None = None) -> None:
        self.gateway = gateway
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.port = http_port
        metadata = [("authorization", f"Bearer {key}")] if key else []
        models = gateway.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5, metadata=metadata).models
        self.model = models[0].name

    def client(self, api_key: str = "unused", **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)


def start_http(engines: list[Engine], run_dir: Path, *extra: str, key: str | None = None) -> Http:
    """A gateway with its HTTP front on a free port, in front of the first engine."""
    port = free_port()
    gateway = start_gateway([engines[0].address], run_dir, "--http-port", str(port), *extra)
    return Http(gateway, port, key)


@pytest.fixture(scope="module")
def http(engines: list[Engine], run_dir: Path) -> Iterator[Http]:
    started = start_http(engines, run_dir)
    wait_until(lambda: started.gateway.num_healthy_backends() == 1, what="the backend in rotation")
    yield started
    assert started.gateway.stop() == 0
    with pytest.raises(OSError):  # the HTTP port is closed with the gateway
        socket.create_connection(("127.0.0.1", started.port), timeout=2).close()


def http_get(url: str, verify: ssl.SSLContext | bool = True) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2, verify=verify)
    except httpx.TransportError:
        return None
