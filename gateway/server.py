"""Runs the gateway: the grpc.aio server, the backend pool, the tokenizer, metrics and shutdown.

Readiness: the gateway is SERVING once it has its model's tokenizer and at least one backend in
rotation, and NOT_SERVING while no backend is; a load balancer (or ``pagedserve up``) waits on it.
SIGTERM: NOT_SERVING for good first; new requests are still served for ``drain_delay_s`` (while
load balancers notice), then the server stops taking new calls and in-flight streams get
``grace_period_s`` to finish.
"""

from __future__ import annotations

import asyncio
import random
import signal
from pathlib import Path

import grpc

from gateway.auth import ApiKeyInterceptor
from gateway.backend.dispatch import Dispatcher
from gateway.backend.pool import Backend, BackendPool
from gateway.backend.routing import Router
from gateway.backend.tokenizer import TokenizerFetchError, fetch_tokenizer
from gateway.config import GatewayConfig
from gateway.core.service import GatewayCore
from gateway.grpc.servicer import GatewayServicer
from gateway.metrics import GatewayMetrics
from gateway.openai_api.app import OpenAIFront
from gateway.openai_api.guard import RequestGuard, allowed_hosts
from gateway.openai_api.server import HttpServer
from gateway.tenants import Tenants
from gateway.traces import TraceparentMiddleware
from pagedserve import rpc, sockets
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.log import get_logger
from pagedserve.trace_context import tracer_for

log = get_logger("gateway")
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


class Gateway:
    """One gateway, built and started inside a running event loop (``await Gateway(config).start()``)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.chat_template = Path(config.chat_template_file).read_text() if config.chat_template_file else None
        self.metrics = GatewayMetrics()
        self.pool = BackendPool(config, self._after_poll)
        # One tenant model for every front of this gateway (see gateway.tenants).
        self.tenants = Tenants(config.tenants, config.max_queued_requests, self.metrics.tenant_changed)
        # The composition root: the core stands on ports (gateway.core.ports), implemented by
        # gateway.backend and wired here; one core, and each front is an edge over it.
        self.dispatcher = Dispatcher(self.pool, Router(config.affinity_max_load_gap, config.affinity_max_load_ratio,
                                                       tier_weight=config.affinity_tier_weight),
                                     config.affinity_max_blocks, self.metrics.routed)
        self.core = GatewayCore(config, self.dispatcher, self.metrics, self.tenants)
        self.tracer = tracer_for(config.otlp_traces_endpoint, "pagedserve-gateway")  # None (no import) when off
        self.core.tracer = self.dispatcher.tracer = self.tracer
        self.servicer = GatewayServicer(self.core)
        interceptors = [ApiKeyInterceptor(self.tenants)] if self.tenants.requires_key else []
        self.server, self.health = rpc.create_aio_server(
            [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, s)], [SERVICE_NAME],
            serving=False, max_message_bytes=config.max_message_bytes, extra_interceptors=interceptors)
        self.http: HttpServer | None = None
        if config.http_port is not None:
            front = OpenAIFront(self.core, lambda: self.health.is_serving and not self._stopping)
            # The gRPC front's certificate serves HTTPS here (TLS on one front only would be a gap).
            app = RequestGuard(front.app, allowed_hosts(config.http_allowed_hosts, self.tenants.requires_key))
            if self.tracer is not None:
                app = TraceparentMiddleware(app)
            self.http = HttpServer(app, config.http_bind_host, config.http_port, config.grace_period_s,
                                   config.tls_cert_file, config.tls_key_file, config.http_read_timeout_s,
                                   config.http_max_connections, self.metrics.http_connection_closed)
        self.address = ""
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._tokenizer_task: asyncio.Task | None = None
        self._stopping = False

    def _after_poll(self, pool: BackendPool) -> None:
        """After each round of health polls: metrics, tokenizer fetch, readiness."""
        for backend in pool.backends.values():
            self.metrics.backend_healthy.labels(backend.address).set(1 if backend.is_healthy else 0)
            self.metrics.backend_outstanding.labels(backend.address).set(backend.num_outstanding)
            if backend.load is not None:
                self.metrics.backend_pending_tokens.labels(backend.address).set(backend.load.num_pending_tokens)
        model = self.core.model
        serving = model is not None and bool(pool.in_rotation(model.info.model_name))
        # No tokenizer yet, or every backend now serves another model (a redeploy): load theirs.
        if not serving and (self._tokenizer_task is None or self._tokenizer_task.done()):
            ready = pool.in_rotation(None)
            if ready:
                self._tokenizer_task = asyncio.create_task(self._load_tokenizer(random.choice(ready)))
        if serving != self.health.is_serving and not self._stopping:
            log.info("gateway_serving" if serving else "gateway_not_serving")
            asyncio.create_task(self.health.set_serving(serving))

    async def _load_tokenizer(self, backend: Backend) -> None:
        try:
            info = backend.info
            if self.chat_template is not None:  # the operator's template instead of the model's
                info = type(info)()
                info.CopyFrom(backend.info)
                info.chat_template = self.chat_template
            model = await fetch_tokenizer(backend.stub, info)
        except (grpc.aio.AioRpcError, TokenizerFetchError, OSError) as exc:  # the next poll round tries again
            log.warning("tokenizer_fetch_failed", backend=backend.address, error=repr(exc))
            return
        self.core.model = model
        log.info("model_ready", model=model.info.model_name, backend=backend.address)
        self._after_poll(self.pool)

    async def start(self) -> None:
        try:
            self.address = sockets.bind(self.server, self.config.listen, self._tls_credentials())
        except RuntimeError:  # grpc's "Failed to bind": the port is taken or the host is not ours
            raise ValueError(
                f"listen: cannot bind {self.config.listen} (in use, or not an address of this host)") from None
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
        if self.http is not None:
            self.http_port = await self.http.start()
        await self.server.start()
        await self.pool.start()
        log.info("gateway_listening", address=self.address, http_port=self.http_port, metrics_port=self.metrics_port,
                 backends=list(self.config.backends), tls=self.config.tls_cert_file is not None,
                 tenants=[t.name for t in self.tenants.tenants] if self.tenants.requires_key else None)

    def _tls_credentials(self) -> grpc.ServerCredentials | None:
        """TLS from the configured PEM files (read at start: a renewed certificate needs a restart)."""
        if self.config.tls_cert_file is None or self.config.tls_key_file is None:
            return None
        try:
            chain, key = Path(self.config.tls_cert_file).read_bytes(), Path(self.config.tls_key_file).read_bytes()
        except OSError as exc:
            raise ValueError(f"tls: cannot read {exc.filename}: {exc.strerror}") from None
        return grpc.ssl_server_credentials([(key, chain)])

    async def stop(self) -> None:
        """NOT_SERVING, then let in-flight calls finish within the grace period."""
        self._stopping = True
        await self.health.shut_down()
        await asyncio.sleep(self.config.drain_delay_s)
        stopping = [self.server.stop(self.config.grace_period_s)]
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        await self.pool.close()
        self.core.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # the spans still batched


async def serve(config: GatewayConfig) -> None:
    """Runs a gateway until SIGTERM or SIGINT."""
    gateway = Gateway(config)
    await gateway.start()
    http = f", OpenAI-compatible HTTP API on {config.http_bind_host}:{gateway.http_port}" if gateway.http else ""
    print(f"gateway listening on {gateway.address}{http}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway_stopping", grace_period_s=config.grace_period_s, in_flight=gateway.core.num_in_flight)
    await gateway.stop()
