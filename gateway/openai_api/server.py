"""Serves the HTTP front with uvicorn inside the gateway's own asyncio event loop.

One loop for both fronts: the HTTP handlers call the same servicer, dispatcher and backend
channels as the gRPC handlers, with no thread hop and no lock. uvicorn runs embedded (its
``serve`` as a task), minus its signal handling: the gateway's SIGTERM sequence stops both fronts.
The socket is bound here, before uvicorn starts, so a taken port is a clear error at start and
port 0 reports the port it got.

Every connection runs under a ``ConnectionGuard`` (read deadlines, a cap on open connections: see
``gateway.openai_api.connections``); the cap is kept to half the process's descriptor limit, so
idle HTTP clients can never take the descriptors the gRPC front and the backends need.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import socket
from collections.abc import Callable, Iterator

import uvicorn
from starlette.types import ASGIApp

from gateway.openai_api.connections import ConnectionGuard, GuardedH11Protocol
from pagedserve.log import get_logger

log = get_logger("gateway.http")


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gateway handles SIGTERM and SIGINT itself (see gateway.server)


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` (TLS when a certificate and key are given).

    Args:
        app: the ASGI app.
        host: bind address.
        port: bind port (0 = any free port; ``start`` returns the one bound).
        grace_period_s: on ``stop``, how long open responses (streams) may take to finish.
        tls_cert_file: PEM certificate chain; with ``tls_key_file``, the front speaks HTTPS.
        tls_key_file: PEM private key.
        read_timeout_s: a request's headers, then its body, must each arrive within this.
        max_connections: connections open at once (at most half the descriptor limit); more are
            answered 503 and closed.
        on_closed: called with the reason of each connection the guard closes.
    """

    def __init__(self, app: ASGIApp, host: str, port: int, grace_period_s: float,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 read_timeout_s: float = 10.0, max_connections: int = 1024,
                 on_closed: Callable[[str], None] | None = None) -> None:
        self.host, self.port = host, port
        self.guard = ConnectionGuard(read_timeout_s, _within_descriptor_limit(max_connections), on_closed)
        # uvicorn's own lines would bypass the structured log; it reports only problems.
        logging.getLogger("uvicorn").setLevel(logging.WARNING)
        protocol = functools.partial(GuardedH11Protocol, guard=self.guard)
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                http=protocol,  # type: ignore[arg-type]  # uvicorn calls it as a class
                                ws="none", timeout_graceful_shutdown=max(int(grace_period_s), 1), server_header=False,
                                ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file)
        self._server = _EmbeddedServer(config)
        self._socket: socket.socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port.

        Raises:
            ValueError: the address cannot be bound (in use, or not an address of this host).
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP, not 0 (socket.create_server's): asyncio turns Nagle's algorithm off
        # (TCP_NODELAY) only on sockets that say they are TCP, and with it on, a response's body
        # waits behind its headers for the client's delayed ACK: 40 ms on every request.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
        except OSError as exc:
            sock.close()
            raise ValueError(f"http: cannot bind {self.host}:{self.port} ({exc.strerror})") from None
        self._socket = sock
        self.port = self._socket.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # it failed to start: raise its error
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stops taking connections; open responses get the grace period, then are cancelled."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task


def _within_descriptor_limit(max_connections: int) -> int:
    """``max_connections``, or half the descriptor limit when that is less (logged)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or max_connections <= soft // 2:
        return max_connections
    log.warning("http_max_connections_lowered", requested=max_connections, used=soft // 2, open_files_limit=soft)
    return max(soft // 2, 1)
