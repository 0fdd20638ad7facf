"""Start, watch and stop a pagedserve service as its own process: the one helper for tests and `up`.

A service is started with its own command line (``python -m memory_service ...``), is ready when
its ``grpc.health.v1`` check says SERVING at its address, and is stopped by PID: SIGTERM first (a
service drains and releases what it holds), SIGKILL after a timeout.

Why the child is tied to its parent: a service started by a test, by ``LLM`` or by ``pagedserve up``
must not outlive its owner, even when the owner is SIGKILLed and cannot clean up. Every service
takes ``--parent-pid PID`` and, first thing in its ``main``, asks the kernel for SIGTERM when that
process dies (``PR_SET_PDEATHSIG``, Linux). It is set by the service itself rather than by a
``preexec_fn`` in the parent: a preexec_fn forces a plain fork(), and gRPC's fork handlers in a
parent with live channels then start a poller thread in the pre-exec child that aborts it now and
then (SIGABRT). The kernel sends the signal when the *thread* that started the child exits, so
start services from a long-lived thread (the main thread, or the thread that also stops them).

Why each service runs in a process group of its own: the owner decides the order of the stop
(``pagedserve up`` drains the gateway first, then the compute service, then the memory service), and a
terminal's Ctrl-C signals the whole foreground process group at once, which would stop all three
together: a memory service gone while the compute service still finishes a request fails it.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import cpu_preload, service_auth

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Called by a service's main for ``--parent-pid``: SIGTERM this process when ``parent_pid`` dies.

    Exits at once when the parent is already gone (it died before the request took effect).
    A no-op off Linux.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        sys.exit(1)


def raise_open_files_limit() -> int:
    """Called first thing by every service's main: RLIMIT_NOFILE's soft limit raised to its hard limit.

    Why: every connection holds a descriptor, and a container's usual soft limit (1024) is reached
    by ~1,000 idle clients, after which neither front can accept anything (accept() fails with
    EMFILE while the TCP backlog keeps filling). The hard limit is the most an unprivileged process
    may take; the services' own caps (HTTP connections, queued requests) are sized below it.

    Returns:
        The soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an infinite hard limit (not on Linux) or a sandbox: keep the soft one
        return soft
    return hard


def exit_skipping_teardown(status: int) -> NoReturn:
    """Ends a service whose main returned ``status`` as the interpreter would, less its module
    teardown: the non-daemon threads joined, the ``atexit`` handlers run (logging's flush among
    them), stdout and stderr flushed, then ``os._exit``. With torch and transformers imported, that
    teardown (a garbage collection of every module's objects) takes a second or more of a stop
    that has nothing left to do (measured: 1.1 s of a tiny model's compute service's 1.15 s from
    SIGTERM to its exit)."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing to flush to
            pass
    os._exit(status)


def add_parent_pid_flag(parser: argparse.ArgumentParser) -> None:
    """The ``--parent-pid`` flag every service takes (see the module docstring)."""
    parser.add_argument(
        "--parent-pid", dest="parent_pid", type=int,
        help="exit (SIGTERM) when this process dies, even by SIGKILL: for a service private to one owner",
    )


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition",
               interval_s: float = 0.05) -> None:
    """Polls ``condition`` until it is true: the one deadline loop of the tests, benchmarks and
    service starts (a fixed sleep either waits too long or, on a loaded machine, not long enough).

    Raises:
        TimeoutError: still false after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


async def async_wait_until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition",
                           interval_s: float = 0.01) -> None:
    """``wait_until`` for code on an event loop: polls between ``asyncio.sleep``s, so the tasks
    that make the condition true (an in-process server's handlers) run meanwhile.

    Raises:
        TimeoutError: still false after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


def check_health(address: str, service: str = "", timeout_s: float = 1.0) -> int | None:
    """One grpc.health.v1 Check: the ServingStatus number, or None when nothing answers."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return None
    return reply.status


class ServiceProcess:
    """One service process: ``ServiceProcess("memory_service", ["--socket", p], address="unix:" + p)``.

    Args:
        module: the service's package, run as ``python -m module``.
        args: its command-line arguments.
        address: where its gRPC health service answers ("unix:/path" or "host:port").
        health_service: the service name to check ("" = the whole server).
        env: environment for the child (default: this process's).
        log_file: when given, the child's stdout and stderr go there (a failed start quotes its
            tail); otherwise they are inherited, so its logs appear with this process's.
        die_with_parent: the child exits when this process dies, even by SIGKILL (it is passed
            ``--parent-pid``, which every pagedserve service takes).
    """

    def __init__(self, module: str, args: Sequence[str] = (), *, address: str, health_service: str = "",
                 env: dict[str, str] | None = None, log_file: str | Path | None = None,
                 die_with_parent: bool = True) -> None:
        self.module = module
        self.args = [str(a) for a in args]
        self.address = address
        self.health_service = health_service
        self.log_file = Path(log_file) if log_file is not None else None
        self._log: IO[bytes] | None = None
        if self.log_file is not None:
            self._log = open(self.log_file, "ab")
        tie = ["--parent-pid", str(os.getpid())] if die_with_parent else []
        # Only the secrets this service uses (service_auth.SECRET_ENVS): never the API keys but in the gateway.
        base = service_auth.env_for_service(module, os.environ if env is None else env)
        if module == "compute_service":  # tcmalloc + Intel OpenMP when installed (cpu_preload.py)
            env = cpu_preload.env_for(self.args, base) or base
        else:  # not for the other services, even when a preloaded process starts them
            env = cpu_preload.strip_env(base)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *self.args, *tie],
            env=env, stdout=self._log, stderr=subprocess.STDOUT if self._log else None, stdin=subprocess.DEVNULL,
            process_group=0,  # the module docstring: a terminal's Ctrl-C reaches the owner alone
        )

    @classmethod
    def launch(cls, module: str, args: Sequence[str] = (), *, address: str, ready_timeout_s: float = 120.0,
               **kwargs: object) -> ServiceProcess:
        """Start the service and wait until it is SERVING; on failure it is stopped and RuntimeError raised."""
        service = cls(module, args, address=address, **kwargs)  # type: ignore[arg-type]
        try:
            service.wait_ready(ready_timeout_s)
        except BaseException:  # KeyboardInterrupt too: never leave a half-started child behind
            service.stop()
            raise
        return service

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the health check says SERVING.

        Raises:
            RuntimeError: the process exited first, or it was not SERVING within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.module} exited with status {self.proc.returncode} before serving{self._tail()}")
            if check_health(self.address, self.health_service, timeout_s=1.0) == health_pb2.HealthCheckResponse.SERVING:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.module} was not SERVING at {self.address} within {timeout_s:.0f} s{self._tail()}")
            time.sleep(0.05)

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        cpu_preload.remove_registration_files(self.proc.pid)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL (a crash, for fault tests); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        status = self.proc.wait()
        cpu_preload.remove_registration_files(self.proc.pid)
        return status

    def _tail(self, num_bytes: int = 4000) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        if self._log is not None:
            self._log.flush()
        data = self.log_file.read_bytes()[-num_bytes:].decode(errors="replace")
        return f"; its log ends with:\n{data}"

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServiceProcess({self.module!r}, pid={self.pid}, address={self.address!r})"
