"""Real processes for the service tests: a memory service and a compute service, started by
``pagedserve.stack``, talked to over their sockets, stopped by PID. The model is the tiny
byte-tokenizer Llama of ``pagedserve_testing/tiny_model.py``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.compute.v1 import compute_pb2_grpc
from pagedserve.memory.v1 import memory_pb2 as mpb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.process import ServiceProcess, wait_until
from pagedserve.stack import compute_process, memory_process, ready, shm_segments

BLOCK_SIZE = 4


def start_memory(socket: Path, *extra: str) -> ServiceProcess:
    return ready(memory_process(socket, ["--block-size", BLOCK_SIZE, "--lease-ttl-s", "2", "--log-level", "warning",
                                         *extra]), 60)


def start_compute(model: Path | str, memory_socket: Path, listen: str, *extra: str,
                  log_file: Path | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
    # float32 unless `extra` says otherwise (a later flag wins): tokens are compared with transformers'.
    args = ["--dtype", "float32",
            "--block-size", BLOCK_SIZE, "--memory-retry-interval-s", "0.2", "--memory-ping-interval-s", "0.2",
            "--log-level", "warning", *extra]
    return ready(compute_process(model, memory_socket, listen, args, log_file=log_file, env=env), 180)


@dataclass
class Services:
    """A running pair and stubs to both."""

    memory: ServiceProcess
    compute: ServiceProcess
    memory_socket: Path
    channel: grpc.Channel
    stub: compute_pb2_grpc.ComputeStub

    def memory_stats(self) -> mpb.StatsResponse:
        with grpc.insecure_channel(f"unix:{self.memory_socket}") as channel:
            return memory_pb2_grpc.MemoryManagerStub(channel).Stats(mpb.StatsRequest(), timeout=10)

    def wait_released(self, timeout_s: float = 10.0) -> mpb.StatsResponse:
        """Memory stats once no sequence holds blocks (a finished or aborted request's blocks go
        back with the engine's next step); fails after ``timeout_s``."""
        wait_until(lambda: self.memory_stats().num_sequences == 0, timeout_s, "every sequence's blocks released",
                   interval_s=0.01)
        return self.memory_stats()

    def used_blocks(self) -> int:
        return sum(p.num_used_blocks for p in self.memory_stats().pools)

    def generate(self, prompt: list[int], timeout: float = 60, **kwargs) -> list[cpb.GenerateResponse]:
        request_fields = {k: kwargs.pop(k) for k in ("request_id", "priority", "cache_salt") if k in kwargs}
        request = cpb.GenerateRequest(prompt_token_ids=prompt, params=cpb.SamplingParams(**kwargs), **request_fields)
        return list(self.stub.Generate(request, timeout=timeout))


@contextmanager
def running_services(model: Path | str, *, memory_args: tuple[str, ...] = ("--max-num-blocks", "128"),
                     compute_args: tuple[str, ...] = (), compute_log: Path | None = None,
                     compute_env: dict[str, str] | None = None) -> Iterator[Services]:
    """Start a memory and a compute service in a private directory; stop both by PID and check that
    both exited cleanly and left no socket and no shared-memory segment behind. A test that swaps
    the memory service (kill, restart) stores the new one in ``services.memory``. ``compute_log``
    collects the compute service's output (else it shows with the test's); ``compute_env``: variables
    set for it on top of this process's environment."""
    with tempfile.TemporaryDirectory(prefix="pscmp-") as directory:
        memory_socket = Path(directory) / "memory.sock"
        listen = f"unix:{directory}/compute.sock"
        memory = start_memory(memory_socket, *memory_args)
        try:
            compute = start_compute(model, memory_socket, listen, *compute_args, log_file=compute_log,
                                    env={**os.environ, **compute_env} if compute_env else None)
        except BaseException:
            memory.stop()
            raise
        channel = grpc.insecure_channel(listen)
        services = Services(memory, compute, memory_socket, channel, compute_pb2_grpc.ComputeStub(channel))
        try:
            yield services
        finally:
            channel.close()
            compute_status = services.compute.stop()
            memory_status = services.memory.stop()
        assert compute_status == 0 and memory_status == 0
        assert not shm_segments(services.memory.pid)
        assert not Path(directory, "compute.sock").exists()
