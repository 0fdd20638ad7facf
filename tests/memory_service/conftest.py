"""A real `python -m memory_service` process per test that needs one (``pagedserve.process.ServiceProcess``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from memory_service.api import KvLayout
from pagedserve.process import ServiceProcess
from pagedserve.stack import memory_process, ready, shm_segments

# Tiny layout: 2 layers, 2 KV heads, head dim 4, 4 tokens per block.
TINY_LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


_ROOT: list[str] = []  # one directory for every service of the session, removed at its end


@pytest.fixture(scope="session", autouse=True)
def _remove_service_directories() -> Iterator[None]:
    yield
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)


def start_memory_service(*extra: str, socket: str | None = None) -> tuple[ServiceProcess, str]:
    """Starts a service (block size 4) on ``socket`` (default: in a fresh private directory), SERVING."""
    if not _ROOT:
        _ROOT.append(tempfile.mkdtemp(prefix="psmem-"))
    directory = tempfile.mkdtemp(dir=_ROOT[0])
    if socket is None:
        socket = os.path.join(directory, "run", "memory.sock")
    service = ready(memory_process(socket, ["--block-size", "4", "--log-level", "warning", *extra],
                                   log_file=os.path.join(directory, "memory_service.log")),  # a failed start quotes it
                    30)
    return service, socket



@pytest.fixture
def memory_service() -> Iterator[str]:
    """Socket path of a fresh memory service with 16 blocks (4 of them reserved for priority >= 1).

    At teardown the service is stopped by PID and must leave neither its socket nor its segment.
    """
    service, socket = start_memory_service("--max-num-blocks", "16", "--reserved-fraction", "0.25",
                                           "--lease-ttl-s", "2")
    yield socket
    assert service.stop() == 0
    assert not Path(socket).exists()
    assert shm_segments(service.pid) == []
