"""Starting and stopping a peer's HTTP server process (vLLM's, llama.cpp's) for the serving benchmark:
ready when ``GET /health`` answers 200; stopped by its process group, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def spawn(cmd: list[str], env: dict[str, str], log_file: Path | None) -> subprocess.Popen:
    """``cmd`` in a session of its own (stopped by its group: `stop_group`), output to ``log_file``."""
    with open(log_file or os.devnull, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def log_tail(log_file: Path | None) -> str:
    """The end of a server's log, for an error message ("" without one)."""
    if log_file and Path(log_file).exists():
        return "; its log ends:\n" + Path(log_file).read_text(errors="replace")[-3000:]
    return ""


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, on_exit: Callable[[int], str]) -> bool:
    """Poll ``base_url``/health until it answers 200 (True) or ``timeout_s`` passes (False).

    Raises:
        RuntimeError: the process exited first; the message is ``on_exit(returncode)``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(on_exit(proc.returncode))
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    return False


def stop_group(proc: subprocess.Popen, timeout_s: float = 30.0, settle_s: float = 10.0) -> int:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session``), wait ``timeout_s`` for
    it, then up to ``settle_s`` for its children to leave (an engine core outlives its server by a
    moment), then SIGKILL what is left; returns its exit status."""
    if proc.poll() is None:
        group = os.getpgid(proc.pid)  # its own session: the group id is its pid
        os.killpg(group, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + settle_s
        try:
            while time.monotonic() < deadline:
                os.killpg(group, 0)
                time.sleep(0.2)
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode
