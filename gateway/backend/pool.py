"""The compute services behind a gateway: health, load accounting, DNS discovery.

A backend is in rotation while its last health poll said SERVING and its model matches the one the
gateway serves. A failed request marks it out at once (passive check); the next poll that
succeeds brings it back, so a restarted compute service rejoins without anyone's help.

The routing's model of a prefix cache belongs to the memory service, not to the backend
(``SharedCaches``): backends whose Info names the same memory service share one ``CacheModel``.
That model outlives a backend's failure. A compute service that restarts finds the same pool; a
memory service that restarts without a tier comes back under a new id (a new, empty model); one
with a disk tier keeps its id (memory_service/identity.py, in the tier's directory) and its blocks,
but only on the disk: its pool and its host-RAM tier (--kv-host-bytes) start empty. Its epoch (new
at each start, reported beside the id) tells: a model that sees a new epoch forgets its pool's
blocks and keeps in its tier model only the newest blocks the disk tier holds (Info.kv_tiers, kind
"disk"), which leaves them predicted as tier hits rather than pool hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.backend.routing import CacheModel
from gateway.config import GatewayConfig, parse_backend
from pagedserve import sampling_rules
from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.log import get_logger
from pagedserve.service_auth import token_interceptors

log = get_logger("gateway.backends")

# Index size before a backend has told its block count.
_DEFAULT_INDEX_CAPACITY = 4096

# Epochs of one memory service remembered: a backend whose compute service has not re-attached yet
# still reports the epoch before a restart, which must not count as yet another restart.
_MAX_EPOCHS = 8

# A backend that refuses connections or says NOT_SERVING leaves the rotation at once; one that is
# merely slow to answer a poll (a busy machine) only after this many slow polls in a row.
_MAX_SLOW_POLLS = 3


class SharedCaches:
    """One ``CacheModel`` per memory service, shared by every backend that reports its id.

    A backend that names no memory service (an older compute service, or one not attached yet)
    gets a model of its own, keyed by its address. Models no backend uses any more are dropped.

    A memory service's epoch not seen before, under an id seen before, is a restart: its pool and
    host tier are empty, so the model forgets the pool's blocks and keeps as many tier blocks as
    its disk tier holds (they stay predicted there; the module docstring). The first epoch of a
    model, and one seen before, forget nothing.
    """

    def __init__(self) -> None:
        self._models: dict[str, CacheModel] = {}
        self._key_of: dict[str, str] = {}  # backend address -> its model's key
        self._epochs: dict[str, list[str]] = {}  # model key -> its memory service's epochs, oldest first

    @staticmethod
    def key(address: str, info: compute_pb2.InfoResponse | None) -> str:
        if info is not None and info.memory_service_id:
            return f"memory:{info.memory_service_id}"
        return f"backend:{address}"

    def model_for(self, address: str, info: compute_pb2.InfoResponse | None) -> CacheModel:
        """The model of the cache behind ``address`` (whose Info is ``info``), sized by that Info."""
        key = self.key(address, info)
        pool_capacity = (info.num_kv_blocks if info is not None else 0) or _DEFAULT_INDEX_CAPACITY
        # The most of any tier, not their sum: a host tier in front of a disk tier holds copies of
        # the disk's blocks (memory_service/tier/worker.py writes through), not others.
        tiers = info.kv_tiers if info is not None else ()
        tier_capacity = max((t.capacity_blocks for t in tiers), default=0)
        # What survives a restart: the disk tier (the host tier is RAM, empty at each start).
        disk_capacity = max((t.capacity_blocks for t in tiers if t.kind == "disk"), default=0)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = CacheModel(pool_capacity, tier_capacity)
        else:
            model.resize(pool_capacity, tier_capacity)
        epoch = info.memory_service_epoch if info is not None and info.memory_service_id else ""
        epochs = self._epochs.setdefault(key, [])
        if epoch and epoch not in epochs:
            if epochs:  # restarted: its pool and host tier are empty, its disk tier may hold what it held
                log.info("memory_service_restarted", memory_service_id=info.memory_service_id, backend=address,
                         disk_tier_blocks=disk_capacity)
                model.forget_restarted(disk_capacity)
            epochs.append(epoch)
            del epochs[:-_MAX_EPOCHS]
        self._key_of[address] = key
        self._drop_unused()
        return model

    def release(self, address: str) -> None:
        """The backend is gone (DNS no longer lists it)."""
        self._key_of.pop(address, None)
        self._drop_unused()

    def _drop_unused(self) -> None:
        for key in set(self._models) - set(self._key_of.values()):
            del self._models[key]
            self._epochs.pop(key, None)


class Ticket:
    """One request's share of a backend's outstanding work, returned exactly once.

    Taken by ``Backend.acquire`` when the request is routed (synchronously, before any await);
    shrinks as the backend reports progress; ``release`` gives back the rest, on finish, abort or
    error alike (it is idempotent, so every exit path may call it).
    """

    def __init__(self, backend: Backend, num_tokens: int) -> None:
        self.backend = backend
        self.num_tokens = num_tokens
        self.is_released = False

    def consume(self, num_tokens: int) -> None:
        """The backend finished ``num_tokens`` of this request's work."""
        num_tokens = min(num_tokens, self.num_tokens)
        self.num_tokens -= num_tokens
        self.backend.outstanding_tokens -= num_tokens

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.backend.outstanding_tokens -= self.num_tokens
            self.backend.num_outstanding -= 1
            self.num_tokens = 0


class Backend:
    """One compute service: its channel, health, reported load and this gateway's work on it."""

    def __init__(self, address: str, options: list[tuple[str, int]], token: str | None = None,
                 caches: SharedCaches | None = None) -> None:
        self.address = address
        self._caches = caches or SharedCaches()
        # With a token, every call on this channel carries it (the compute service refuses others).
        interceptors = token_interceptors(token) if token else None
        self.channel = grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        self.stub = compute_pb2_grpc.ComputeStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.is_healthy = False
        self.info: compute_pb2.InfoResponse | None = None
        self.load: compute_pb2.LoadResponse | None = None
        self.cache = self._caches.model_for(address, None)  # what the router predicts it holds
        self.num_outstanding = 0  # requests routed here by this gateway, not yet finished
        self.outstanding_tokens = 0  # their prompts not yet prefilled plus tokens not yet generated
        self._other_tokens = 0  # reported pending tokens that are not this gateway's
        self._num_slow_polls = 0

    def work(self) -> int:
        """Outstanding tokens of every gateway on this backend (the router's load measure)."""
        return self.outstanding_tokens + self._other_tokens

    def acquire(self, num_tokens: int) -> Ticket:
        """Counts a request routed here (call in the same event-loop step as routing)."""
        self.num_outstanding += 1
        self.outstanding_tokens += num_tokens
        return Ticket(self, num_tokens)

    def mark_failed(self, reason: str) -> None:
        """Takes the backend out of rotation until a health poll succeeds again."""
        if self.is_healthy:
            log.warning("backend_out_of_rotation", backend=self.address, reason=reason)
        self.is_healthy = False
        if self.info is None or not self.info.memory_service_id:
            # Its cache may be gone (a restart), and nothing will tell: stale affinity would only mislead.
            # A named memory service's model stays (see the module's docstring).
            self.cache.forget_pool()

    async def poll(self, timeout_s: float) -> None:
        """Health check + Load (+ Info once); updates ``is_healthy`` and the reported load."""
        try:
            health, load = await asyncio.gather(
                self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s),
                self.stub.Load(compute_pb2.LoadRequest(), timeout=timeout_s),
            )
            # (Re)joining: it may serve another model now. Or its memory service changed under it
            # (restarted between two polls, the compute service re-attached): another cache, or the
            # same one with an empty pool (a new epoch under the same id).
            if (self.info is None or not self.is_healthy
                    or load.memory_service_id not in ("", self.info.memory_service_id)
                    or load.memory_service_epoch not in ("", self.info.memory_service_epoch)):
                self.info = await self.stub.Info(compute_pb2.InfoRequest(), timeout=timeout_s)
                # A compute service between two leases (its memory service restarting) describes no
                # pool: its model stays until it attaches and names one. Switching to a model of its
                # own would drop the memory service's model, tier predictions included.
                if self.info.num_kv_blocks:
                    self.cache = self._caches.model_for(self.address, self.info)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._num_slow_polls += 1
                if self._num_slow_polls < _MAX_SLOW_POLLS:
                    return  # keep its last known state
            self.mark_failed(f"{exc.code().name}: {exc.details()}")
            return
        self._num_slow_polls = 0
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            self.mark_failed("NOT_SERVING")
            return
        self.load = load
        # The engine's pending tokens include this gateway's requests (counted in our own counter).
        self._other_tokens = max(0, load.num_pending_tokens - self.outstanding_tokens)
        if not self.is_healthy:
            log.info("backend_in_rotation", backend=self.address, model=self.info.model_name)
        self.is_healthy = True

    async def close(self) -> None:
        await self.channel.close()


class BackendPool:
    """Every backend of the gateway, kept up to date by a poll loop and (for dns:) a resolve loop.

    Args:
        config: the gateway's config (addresses, intervals, message limits).
        on_poll: called after every round of health polls (metrics, readiness).
    """

    def __init__(self, config: GatewayConfig, on_poll: Callable[[BackendPool], None]) -> None:
        self.config = config
        self.backends: dict[str, Backend] = {}
        self.caches = SharedCaches()
        self._on_poll = on_poll
        # The compute service's own wire limit, both ways (sized from the request limits).
        wire_bytes = sampling_rules.max_message_bytes()
        self._options = [("grpc.max_receive_message_length", wire_bytes),
                         ("grpc.max_send_message_length", wire_bytes)]
        self._dns_names: list[tuple[str, int]] = []
        for address in config.backends:
            kind, host, port = parse_backend(address)
            if kind == "dns":
                self._dns_names.append((host, port))
            else:
                self._add(address)
        self._tasks: list[asyncio.Task] = []

    def _add(self, address: str) -> None:
        if address not in self.backends:
            self.backends[address] = Backend(address, self._options, self.config.backend_token, self.caches)

    def in_rotation(self, model_name: str | None) -> list[Backend]:
        """Healthy backends that serve ``model_name`` (any model when None)."""
        return [b for b in self.backends.values()
                if b.is_healthy and (model_name is None or (b.info is not None and b.info.model_name == model_name))]

    async def start(self) -> None:
        if self._dns_names:
            await self.resolve()
        await self.poll_all()
        self._tasks = [asyncio.create_task(self._poll_loop())]
        if self._dns_names:
            self._tasks.append(asyncio.create_task(self._resolve_loop()))

    async def poll_all(self) -> None:
        timeout = max(self.config.health_interval_s, 1.0)
        await asyncio.gather(*(b.poll(timeout) for b in list(self.backends.values())))
        self._on_poll(self)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.poll_all()

    async def resolve(self) -> None:
        """Resolve every dns: name; add new addresses, drop those gone (finishing their streams)."""
        loop = asyncio.get_running_loop()
        found: set[str] = set()
        for name, port in self._dns_names:
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                log.warning("dns_resolve_failed", name=name, error=str(exc))
                return  # keep the current set rather than dropping every backend on a DNS blip
            for family, _, _, _, sockaddr in infos:
                host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
                found.add(f"{host}:{sockaddr[1]}")
        static = {a for a in self.config.backends if not a.startswith("dns:")}
        for address in found - self.backends.keys():
            log.info("backend_discovered", backend=address)
            self._add(address)
        for address in set(self.backends) - found - static:
            backend = self.backends.pop(address)
            self.caches.release(address)
            log.info("backend_removed", backend=address)
            # Streams still running on it keep their channel until they end.
            asyncio.get_running_loop().call_later(self.config.grace_period_s, asyncio.ensure_future, backend.close())

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_refresh_s)
            await self.resolve()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(b.close() for b in self.backends.values()))
