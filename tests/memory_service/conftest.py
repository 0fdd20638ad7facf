"""A real `python -m memory_service` process per test that needs one."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memory_service.pool import KvLayout

# Tiny layout: 2 layers, 2 KV heads, head dim 4, 4 tokens per block.
TINY_LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def start_memory_service(*extra: str) -> tuple[subprocess.Popen, str]:
    directory = tempfile.mkdtemp(prefix="psmem-")
    socket = os.path.join(directory, "run", "memory.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memory_service", "--socket", socket, "--block-size", "4", "--log-level", "warning", *extra],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not Path(socket).exists():
        if proc.poll() is not None:
            raise RuntimeError(f"memory service exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("memory service did not start")
        time.sleep(0.02)
    return proc, socket


@pytest.fixture
def memory_service() -> Iterator[str]:
    """Socket path of a fresh memory service with 16 blocks (4 of them reserved for priority >= 1)."""
    proc, socket = start_memory_service("--max-num-blocks", "16", "--reserved-fraction", "0.25", "--lease-ttl-s", "2")
    yield socket
    proc.terminate()
    proc.wait(timeout=10)
