"""The stacks the serving benchmark starts for itself: memory, compute and gateway as three real
processes each (``python -m ...`` through ServiceProcess, as ``pagedserve up`` and the tests start
them). Several stacks start side by side, so that their model loads overlap.

Memory and compute talk over Unix sockets in a private (0700) directory made for each stack; the
gateway listens on a free local TCP port. Stopping goes gateway first (no new requests), memory
service last (it owns the KV pool's shared memory and unlinks it as it exits), and removes the
directory. Prefix caching is switched where the cache lives, in the memory service
(``--enable-prefix-caching``): the compute service asks for prefix matches on every admission and
gets none from a memory service without a cache.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.serving.client import Target
from pagedserve.process import ServiceProcess
from pagedserve.sockets import free_port

MEMORY_SERVICE = "pagedserve.memory.v1.MemoryManager"
COMPUTE_SERVICE = "pagedserve.compute.v1.Compute"
GATEWAY_SERVICE = "pagedserve.gateway.v1.Gateway"


@dataclass(frozen=True)
class StackConfig:
    """What to start.

    Args:
        model: "default" or a local Hugging Face model directory.
        kv_cache_bytes: the KV pool's size.
        block_size: tokens per KV block (memory and compute must agree).
        enable_prefix_caching: the memory service's prefix cache.
        max_num_seqs: the engine's running sequences at most (None = its default).
        max_num_batched_tokens: the engine's new tokens per step, prompt chunks included (None = its
            default): how long one step's prefill may stall the running sequences' next tokens.
        ready_timeout_s: how long each service may take to become SERVING (model loading included).
    """

    model: str = "default"
    kv_cache_bytes: int = 512 << 20
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")


@dataclass
class ServingStack:
    """One started stack: its private directory and its services (memory, compute, gateway)."""

    config: StackConfig
    directory: Path
    services: list[ServiceProcess] = field(default_factory=list)
    http_port: int = 0  # the gateway's HTTP front

    def _spawn(self, module: str, args: list, address: str, health_service: str) -> ServiceProcess:
        """Start a service (not waiting for it); its output goes to a log in the stack's directory."""
        service = ServiceProcess(module, [str(a) for a in args], address=address, health_service=health_service,
                                 log_file=self.directory / f"{module}.log")
        self.services.append(service)
        return service

    def _spawn_memory(self) -> ServiceProcess:
        socket = self.directory / "memory.sock"
        return self._spawn("memory_service", [
            "--socket", socket, "--kv-cache-bytes", self.config.kv_cache_bytes, "--block-size",
            self.config.block_size, "--enable-prefix-caching", str(self.config.enable_prefix_caching).lower(),
            "--log-level", "warning"], f"unix:{socket}", MEMORY_SERVICE)

    def _spawn_compute(self) -> ServiceProcess:
        args = ["--memory-socket", self.directory / "memory.sock", "--model", self.config.model,
                "--listen", f"unix:{self.directory / 'compute.sock'}", "--block-size", self.config.block_size,
                "--log-level", "warning"]
        for flag, value in (("--max-num-seqs", self.config.max_num_seqs),
                            ("--max-num-batched-tokens", self.config.max_num_batched_tokens)):
            if value is not None:
                args += [flag, value]
        return self._spawn("compute_service", args, f"unix:{self.directory / 'compute.sock'}", COMPUTE_SERVICE)

    def _spawn_gateway(self) -> ServiceProcess:
        address = f"127.0.0.1:{free_port()}"
        # SERVING once it has the tokenizer and a backend in rotation (gateway/server.py).
        self.http_port = free_port()
        return self._spawn("gateway", ["--backend", f"unix:{self.directory / 'compute.sock'}", "--listen", address,
                                       "--http-port", self.http_port, "--health-interval-s", "0.5",
                                       "--log-level", "warning"],
                           address, GATEWAY_SERVICE)

    @property
    def memory_address(self) -> str:
        return self.services[0].address

    @property
    def gateway_address(self) -> str:
        return self.services[2].address

    def target(self, api: str) -> Target:
        """Where the benchmark sends: the gateway's gRPC front, or its OpenAI-compatible HTTP front."""
        if api == "openai":
            return Target(f"http://127.0.0.1:{self.http_port}", "openai")
        return Target(self.gateway_address, "grpc")

    @property
    def pids(self) -> dict[str, int]:
        return {s.module: s.pid for s in self.services}

    def stop(self) -> dict[str, int]:
        """Stop gateway, compute, memory (in that order) by PID; returns their exit statuses."""
        statuses = {s.module: s.stop(timeout_s=30) for s in reversed(self.services)}
        shutil.rmtree(self.directory, ignore_errors=True)
        return statuses



def start_stacks(configs: list[StackConfig]) -> list[ServingStack]:
    """Start one stack per config, side by side: every memory service, then every compute service
    (their model loads overlap), then every gateway, each tier SERVING before the next. On any
    failure (KeyboardInterrupt included) everything started is stopped and the error raised."""
    stacks = [ServingStack(c, Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))) for c in configs]
    try:
        for spawn in (ServingStack._spawn_memory, ServingStack._spawn_compute, ServingStack._spawn_gateway):
            started = [(spawn(stack), stack.config.ready_timeout_s) for stack in stacks]
            for service, timeout_s in started:
                service.wait_ready(timeout_s)
    except BaseException:
        for stack in stacks:
            stack.stop()
        raise
    return stacks
