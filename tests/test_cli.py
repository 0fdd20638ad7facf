"""Entry points answer --help, and `pagedserve up` serves until SIGTERM."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc


@pytest.mark.parametrize("cmd", [["-m", "memory_service"], ["-m", "pagedserve.cli"], ["-m", "pagedserve.cli", "up"],
                                 ["-m", "pagedserve.cli", "generate"]])
def test_help(cmd: list[str]) -> None:
    out = subprocess.run([sys.executable, *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_bad_flag_value_is_a_clear_error() -> None:
    out = subprocess.run([sys.executable, "-m", "memory_service", "--block-size", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "block_size" in out.stderr


def test_up_serves_the_memory_service_until_sigterm() -> None:
    socket = os.path.join(tempfile.mkdtemp(prefix="psup-"), "memory.sock")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "up", "--socket", socket],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while not Path(socket).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stub = memory_pb2_grpc.MemoryManagerStub(grpc.insecure_channel(f"unix:{socket}"))
        assert stub.Ping(memory_pb2.PingRequest(), timeout=10) == memory_pb2.PingResponse()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
