"""ServiceProcess: a real service started by its command, ready by health, stopped by PID, tied to its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedserve.process import ServiceProcess, check_health


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie still answers kill(pid, 0): it is gone once its state is Z.
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"):
            return True
        time.sleep(0.05)
    return False


def test_launch_ready_then_stop_leaves_nothing(tmp_path: Path) -> None:
    socket = tmp_path / "run" / "memory.sock"
    service = ServiceProcess.launch(
        "memory_service", ["--socket", socket, "--max-num-blocks", "8", "--block-size", "4", "--log-level", "warning"],
        address=f"unix:{socket}", health_service="pagedserve.memory.v1.MemoryManager", ready_timeout_s=60,
    )
    assert service.is_running() and check_health(service.address) == 1  # SERVING
    assert service.stop() == 0
    assert not service.is_running() and not socket.exists()
    assert check_health(service.address, timeout_s=0.2) is None


def test_failed_start_quotes_the_log_and_leaves_no_process(tmp_path: Path) -> None:
    log = tmp_path / "memory.log"
    with pytest.raises(RuntimeError, match="exited with status 2 before serving") as info:
        ServiceProcess.launch("memory_service", ["--block-size", "-3"], address=f"unix:{tmp_path}/none.sock",
                              log_file=log, ready_timeout_s=30)
    assert "block_size" in str(info.value)


def test_child_dies_when_its_owner_is_sigkilled(tmp_path: Path) -> None:
    socket = tmp_path / "memory.sock"
    pid_file = tmp_path / "child.pid"
    owner = textwrap.dedent(f"""
        import time
        from pagedserve.process import ServiceProcess
        s = ServiceProcess.launch("memory_service", ["--socket", {str(socket)!r}, "--max-num-blocks", "8",
                                  "--log-level", "warning"], address="unix:{socket}", ready_timeout_s=60)
        open({str(pid_file)!r}, "w").write(str(s.pid))
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", owner])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(child), "the service outlived its SIGKILLed owner"
    finally:
        if parent.poll() is None:
            parent.kill()
