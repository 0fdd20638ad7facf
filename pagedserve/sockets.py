"""Listening addresses of the servers: Unix sockets made safe, TCP ports bound.

A Unix socket is the memory service's front door: whoever can connect can read and write every
tenant's KV cache. So the socket is created owner-only, in a directory only its owner can change:

- the directory is created 0700 when absent; an existing one must belong to this user and not be
  group- or world-writable (another user could otherwise replace the socket with their own);
- the path may hold nothing but a *stale* socket: a regular file (or anything else) is refused,
  never deleted, and a socket that a live server answers on is refused too (two services on one
  path would leave the first unreachable with its own pool);
- the socket is created under umask 0177, so it is 0600 from its first instant, not 0755 for a
  moment before a chmod.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc

from pagedserve.errors import PreconditionError


def default_socket_path() -> str:
    """Per-user private directory for the memory service's socket."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/pagedserve-{os.getuid()}"
    return str(Path(runtime) / "memory.sock")


def check_socket_directory(directory: Path) -> None:
    """Creates ``directory`` 0700 when absent; refuses one that another user could change.

    Raises:
        PreconditionError: it belongs to another user or is group/world-writable, or is no directory.
    """
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o700)
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise PreconditionError(f"socket directory {directory} is not a directory")
    if info.st_uid != os.getuid():
        raise PreconditionError(f"socket directory {directory} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & 0o022:
        raise PreconditionError(
            f"socket directory {directory} is group- or world-writable (mode {stat.S_IMODE(info.st_mode):o}): "
            "use a private directory (0700)"
        )


def is_live_socket(path: Path) -> bool:
    """Tells whether a server accepts connections on the Unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:  # refused (no listener: stale), or gone meanwhile
            return False
    return True


def prepare_unix_socket(path: Path) -> None:
    """Makes ``path`` ready to bind: a safe directory, and at most a stale socket there (removed).

    Raises:
        PreconditionError: unsafe directory, a non-socket at the path, or a live server on it.
    """
    check_socket_directory(path.parent)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise PreconditionError(f"{path} exists and is not a socket: refusing to replace it")
    if is_live_socket(path):
        raise PreconditionError(f"a server is already listening on {path}: stop it first or choose another --socket")
    path.unlink()  # stale: its server died without removing it (SIGKILL)


@contextlib.contextmanager
def owner_only_umask() -> Iterator[None]:
    """Files created inside are at most 0600 (process-wide: use while starting, before serving)."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


def bind(server: grpc.Server | grpc.aio.Server, address: str,
         credentials: grpc.ServerCredentials | None = None) -> str:
    """Binds ``address`` ("unix:/path/to.sock" or "host:port") and returns the bound address.

    With ``credentials`` (``grpc.ssl_server_credentials``) a TCP port serves TLS only.

    A Unix socket goes through ``prepare_unix_socket`` and is created owner-only (module
    docstring). A TCP port of 0 picks a free port; the returned address names it.

    Raises:
        PreconditionError: a Unix socket path that is unsafe or taken.
        ValueError: a TCP address that cannot be bound.
    """
    if address.startswith("unix:"):
        prepare_unix_socket(Path(address[len("unix:") :]))
        with owner_only_umask():
            server.add_insecure_port(address)
        return address
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise ValueError(f"cannot bind address {address!r}")
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for a child process's --listen).

    Drawn at random from the 16k ports just below the kernel's ephemeral range, not from it: a port
    the kernel hands out (bind to 0) is the kind it also gives every outgoing connection, so between
    this probe and the child's bind another process's client socket could take it ("Address already
    in use"; seen with parallel test workers). Below the range only another explicit bind can."""
    high = _ephemeral_low()
    low = max(1024, high - 16384)
    for _ in range(64 if high - low >= 1024 else 0):  # (an ephemeral range from 1024 leaves none below)
        port = random.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # a crowded range: the kernel's choice
        probe.bind((host, 0))
        return probe.getsockname()[1]


def secure_socket(address: str) -> None:
    """chmod 0600 the socket file of a started server bound to a unix: address (belt and braces)."""
    if address.startswith("unix:"):
        os.chmod(address[len("unix:") :], 0o600)
