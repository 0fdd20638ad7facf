"""ServiceProcess: a real service started by its command, ready by health, stopped by PID, tied to its parent."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedserve.process import ServiceProcess, check_health, wait_until
from pagedserve.service_auth import env_for_service
from tests.processes import is_gone, lowered_open_files_limit, open_files_limits


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


def test_a_service_raises_its_open_files_limit_to_the_hard_limit(tmp_path: Path) -> None:
    """Started under a soft limit of 256 descriptors (a container's 1024, lower
    still), the service runs with its hard limit: idle connections cannot exhaust it as early."""
    socket = tmp_path / "memory.sock"
    with lowered_open_files_limit(256):
        service = ServiceProcess("memory_service", ["--socket", socket, "--max-num-blocks", "8", "--block-size", "4",
                                                    "--log-level", "warning"], address=f"unix:{socket}")
    try:
        service.wait_ready(60)
        soft, hard = open_files_limits(service.pid)
        assert soft == hard and hard > 256
    finally:
        assert service.stop() == 0


def test_a_service_gets_only_the_secrets_it_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API keys were in every service's /proc/PID/environ. The memory service
    keeps its own token and nothing of the gateway's or the client's."""
    secrets = {"PAGEDSERVE_API_KEYS": "key-one-0123456789", "PAGEDSERVE_API_KEY": "client-key-0123456789",
               "PAGEDSERVE_COMPUTE_TOKEN": "compute-token-0123456789",
               "PAGEDSERVE_MEMORY_TOKEN": "memory-token-0123456789"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    socket = tmp_path / "memory.sock"
    service = ServiceProcess.launch("memory_service", ["--socket", socket, "--max-num-blocks", "8", "--block-size", "4",
                                                       "--log-level", "warning"],
                                    address=f"unix:{socket}", health_service="pagedserve.memory.v1.MemoryManager",
                                    ready_timeout_s=60)
    try:
        environ = Path(f"/proc/{service.pid}/environ").read_bytes().split(b"\0")
        names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
        assert names & set(secrets) == {"PAGEDSERVE_MEMORY_TOKEN"}
        assert not any(value.encode() in Path(f"/proc/{service.pid}/environ").read_bytes()
                       for name, value in secrets.items() if name != "PAGEDSERVE_MEMORY_TOKEN")
    finally:
        assert service.stop() == 0
    assert env_for_service("gateway", secrets).keys() == {"PAGEDSERVE_API_KEYS", "PAGEDSERVE_COMPUTE_TOKEN"}
    assert env_for_service("compute_service", {**secrets, "HOME": "/h"}).keys() == {
        "PAGEDSERVE_COMPUTE_TOKEN", "PAGEDSERVE_MEMORY_TOKEN", "HOME"}


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
        def started() -> bool:
            assert parent.poll() is None, "the owner exited before starting its service"
            return pid_file.exists() and bool(pid_file.read_text())

        wait_until(started, 60, "the owner's service started")
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: is_gone(child), 10, "the service gone after its owner was SIGKILLed")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_exit_skipping_teardown_keeps_what_a_normal_exit_does_but_the_module_teardown() -> None:
    """A service's clean exit: its non-daemon threads finish, its atexit handlers run, buffered
    output is written and the status is kept; only the modules' teardown (an object's __del__ run
    by it here, a second of garbage collection with torch loaded) is skipped."""
    script = textwrap.dedent("""
        import atexit, sys, threading, time
        from pagedserve.process import exit_skipping_teardown

        class Teardown:
            def __del__(self):
                print("teardown ran", flush=True)

        KEPT = Teardown()
        atexit.register(lambda: print("atexit ran"))
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread ran"))).start()
        sys.stdout.write("buffered")
        exit_skipping_teardown(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["bufferedthread ran", "atexit ran"]
