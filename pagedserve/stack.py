"""One launcher for the whole stack (memory service, compute service, gateway) on one machine.

``pagedserve up``, the benchmarks, the tests and ``LLM``'s private memory service all start their
services here, so the command line of each service, the names of their health services and the
order of starting and stopping are written once.

A stack lives in one directory (0700): the memory and compute services talk over Unix sockets in
it, the gateway listens on TCP, and each service's output goes to a log beside the sockets unless
the stack is asked to inherit it. Each tier is SERVING before the next starts (the compute service
attaches to the memory service, the gateway fetches the tokenizer from the compute service).
Stopping goes gateway first (no new requests), memory service last (it owns the KV pool's shared
memory and unlinks it as it exits); a directory the stack made is removed then.

The memory service gets a token of the stack's own (a fresh random one in ``memory.token``, 0600,
beside the sockets; both services are given its path, never the token): only the stack's compute
service may name cache namespaces there (memory_service/service/trust.py).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.process import ServiceProcess
from pagedserve.sockets import free_port

MEMORY_SERVICE = "pagedserve.memory.v1.MemoryManager"
COMPUTE_SERVICE = "pagedserve.compute.v1.Compute"
GATEWAY_SERVICE = "pagedserve.gateway.v1.Gateway"
# The health service each module's server reports (its gRPC service's full name).
HEALTH_SERVICES = {"memory_service": MEMORY_SERVICE, "compute_service": COMPUTE_SERVICE, "gateway": GATEWAY_SERVICE}
# The memory service names its CPU pool segments after its PID (memory_service/pool/kv_pool.py).
SHM_PREFIX = "pagedserve-kv-"


def shm_segments(pid: int) -> list[Path]:
    """The shared-memory KV pool segments of the memory service with this PID (none once it exited)."""
    return sorted(Path("/dev/shm").glob(f"{SHM_PREFIX}{pid}-*"))


def ready(service: ServiceProcess, timeout_s: float) -> ServiceProcess:
    """``service`` once it is SERVING; stopped, and the error raised, when it is not (KeyboardInterrupt too)."""
    try:
        service.wait_ready(timeout_s)
    except BaseException:
        service.stop()
        raise
    return service


def memory_process(socket: str | Path, args: Sequence[object] = (), *,
                   log_file: str | Path | None = None) -> ServiceProcess:
    """``python -m memory_service`` on ``socket`` (started, not yet waited for)."""
    return ServiceProcess("memory_service", ["--socket", socket, *args], address=f"unix:{socket}",
                          health_service=HEALTH_SERVICES["memory_service"], log_file=log_file)


def compute_process(model: str | Path, memory_socket: str | Path, listen: str, args: Sequence[object] = (), *,
                    log_file: str | Path | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
    """``python -m compute_service`` serving ``model`` on ``listen``, attached to ``memory_socket``."""
    return ServiceProcess("compute_service", ["--model", model, "--memory-socket", memory_socket, "--listen", listen,
                                              *args],
                          address=listen, health_service=COMPUTE_SERVICE, log_file=log_file, env=env)


def gateway_process(backends: Sequence[str], listen: str, args: Sequence[object] = (), *,
                    log_file: str | Path | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
    """``python -m gateway`` on ``listen`` in front of ``backends``; SERVING once it has the tokenizer
    and a backend in rotation (gateway/server.py)."""
    backend_args = [a for backend in backends for a in ("--backend", backend)]
    return ServiceProcess("gateway", [*backend_args, "--listen", listen, *args], address=listen,
                          health_service=GATEWAY_SERVICE, log_file=log_file, env=env)


@dataclass(frozen=True)
class StackConfig:
    """What one stack starts.

    Args:
        model: "default" or a local Hugging Face model directory.
        memory_args, compute_args, gateway_args: each service's further command-line arguments
            (the sockets, the model and the backend are the stack's).
        gateway_host: the gateway's bind host.
        gateway_port: the gateway's port (0 = a free one).
        name: prefix of the socket and log names, for several stacks in one directory.
        log_to_files: each service's output goes to ``<name>memory.log``, ``compute.log``, ``gateway.log`` in the
            stack's directory (a failed start quotes its tail); False: inherited from this process.
        ready_timeout_s: how long each service may take to become SERVING (model loading included).
    """

    model: str = "default"
    memory_args: tuple[str, ...] = ()
    compute_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0
    name: str = ""
    log_to_files: bool = True
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 <= self.gateway_port < 65536:
            raise ValueError(f"gateway_port must be in [0, 65536), got {self.gateway_port}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")


class Stack:
    """One stack's directory and services; ``start_stack`` starts all three, or call ``spawn_*`` tier
    by tier (``pagedserve up`` waits with a progress line of its own).

    Args:
        config: what to start.
        directory: where its sockets and logs go (made 0700); None: a fresh temporary directory,
            removed by ``stop``.
    """

    def __init__(self, config: StackConfig, directory: str | Path | None = None) -> None:
        self.config = config
        self._owns_directory = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="pagedserve-") if directory is None else directory)
        os.chmod(self.directory, 0o700)  # only this user reaches the sockets
        self.memory_token_file = self.directory / f"{config.name}memory.token"
        if not self.memory_token_file.exists():  # a directory reused by a new stack keeps its token
            fd = os.open(self.memory_token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
        self.memory: ServiceProcess | None = None
        self.compute: ServiceProcess | None = None
        self.gateway: ServiceProcess | None = None
        self.old_memory_pids: list[int] = []  # memory services replaced by restart_memory
        self._restarts = 0

    @property
    def memory_socket(self) -> Path:
        return self.directory / f"{self.config.name}memory.sock"

    @property
    def compute_address(self) -> str:
        return f"unix:{self.directory / f'{self.config.name}compute.sock'}"

    @property
    def services(self) -> list[ServiceProcess]:
        """The started services, in starting order."""
        return [s for s in (self.memory, self.compute, self.gateway) if s is not None]

    def _log(self, role: str) -> Path | None:
        if not self.config.log_to_files:
            return None
        suffix = f"-{self._restarts + 1}" if self._restarts else ""  # a restarted service's log beside the first
        return self.directory / f"{self.config.name}{role}{suffix}.log"

    def spawn_memory(self) -> ServiceProcess:
        self.memory = memory_process(self.memory_socket,
                                     ["--auth-token-file", self.memory_token_file, *self.config.memory_args],
                                     log_file=self._log("memory"))
        return self.memory

    def spawn_compute(self) -> ServiceProcess:
        self.compute = compute_process(self.config.model, self.memory_socket, self.compute_address,
                                       ["--memory-token-file", self.memory_token_file, *self.config.compute_args],
                                       log_file=self._log("compute"))
        return self.compute

    def spawn_gateway(self) -> ServiceProcess:
        port = self.config.gateway_port or free_port(self.config.gateway_host)
        self.gateway = gateway_process([self.compute_address], f"{self.config.gateway_host}:{port}",
                                       self.config.gateway_args, log_file=self._log("gateway"))
        return self.gateway

    def restart_memory(self) -> ServiceProcess:
        """A new memory service on the same socket (after a kill: the compute service re-attaches)."""
        assert self.memory is not None
        self.old_memory_pids.append(self.memory.pid)
        self.memory.stop()
        self._restarts += 1
        return ready(self.spawn_memory(), self.config.ready_timeout_s)

    def restart_compute(self) -> ServiceProcess:
        """A new compute service on the same socket, attached to the same memory service."""
        assert self.compute is not None
        self.compute.stop()
        self._restarts += 1
        return ready(self.spawn_compute(), self.config.ready_timeout_s)

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Stops gateway, compute, memory (in that order) by PID; returns their exit statuses by module."""
        statuses = {s.module: s.stop(timeout_s=timeout_s) for s in reversed(self.services)}
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        return statuses

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_stacks(stacks: Sequence[Stack], *, with_gateway: bool = True) -> list[Stack]:
    """Starts stacks side by side: every memory service, then every compute service (their model
    loads overlap), then every gateway (unless ``with_gateway`` is False: an engine pod), each tier
    SERVING before the next. On any failure (KeyboardInterrupt included) everything started is
    stopped and the error raised."""
    tiers = [Stack.spawn_memory, Stack.spawn_compute] + ([Stack.spawn_gateway] if with_gateway else [])
    try:
        for spawn in tiers:
            started = [(spawn(stack), stack.config.ready_timeout_s) for stack in stacks]
            for service, timeout_s in started:
                service.wait_ready(timeout_s)
    except BaseException:
        for stack in stacks:
            stack.stop()
        raise
    return list(stacks)


def start_stack(config: StackConfig, directory: str | Path | None = None, *, with_gateway: bool = True) -> Stack:
    """One stack, started and SERVING (see ``start_stacks``)."""
    return start_stacks([Stack(config, directory)], with_gateway=with_gateway)[0]
