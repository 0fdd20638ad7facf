"""``grpc.health.v1.Health`` for the asyncio servers, with Watch streams bounded.

Health needs no key (probes carry none), so whoever reaches a port can open Watch streams; the
reference servicer accepts any number, and each holds a task and a send buffer for its life. This
one accepts at most ``max_watches_per_peer`` per connection and ``max_watches`` in all, answering
RESOURCE_EXHAUSTED beyond.

Why Watch is rewritten rather than wrapped: the reference Watch writes while holding the
condition that ``set`` also takes, so one watcher that stops reading (its write blocked on flow
control) blocks every later ``set`` -- the server could then never turn NOT_SERVING. Here the
write happens outside the lock. A cancel that meets a write in flight ends the stream with one
debug line, not a traceback.
"""

from __future__ import annotations

import collections

import grpc
from grpc._cython.cygrpc import ExecuteBatchError
from grpc_health.v1 import health, health_pb2

from pagedserve.log import get_logger

log = get_logger("rpc.health")

MAX_WATCHES_PER_PEER = 16
MAX_WATCHES = 1024
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def is_ended_call_error(exc: BaseException, context: grpc.aio.ServicerContext) -> bool:
    """Whether ``exc``, raised by a write, says only that the call has ended (cancelled, peer gone).

    grpc.aio fails such a write with ``ExecuteBatchError`` before it marks the context
    cancelled, so both are asked.
    """
    return isinstance(exc, ExecuteBatchError) or context.cancelled()


class HealthServicer(health.aio.HealthServicer):
    """The health service of one asyncio server (``set``, ``enter_graceful_shutdown`` as usual).

    Args:
        max_watches_per_peer: Watch streams one connection may hold.
        max_watches: Watch streams the server holds in all.
    """

    def __init__(self, max_watches_per_peer: int = MAX_WATCHES_PER_PEER, max_watches: int = MAX_WATCHES) -> None:
        super().__init__()
        self.max_watches_per_peer = max_watches_per_peer
        self.max_watches = max_watches
        self.num_watches_by_peer: collections.Counter[str] = collections.Counter()

    @property
    def num_watches(self) -> int:
        return sum(self.num_watches_by_peer.values())

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer() or ""
        if self.num_watches_by_peer[peer] >= self.max_watches_per_peer:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"at most {self.max_watches_per_peer} health Watch streams per connection")
        if self.num_watches >= self.max_watches:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server holds {self.max_watches} health Watch streams; retry later")
        self.num_watches_by_peer[peer] += 1
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        try:
            last_status = None
            while True:
                status = self._server_status.get(service, _UNKNOWN)
                if status != last_status:
                    try:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    except Exception as exc:  # only a write to a call that has ended
                        if not is_ended_call_error(exc, context):
                            raise
                        log.debug("health_watch_cancelled_during_write", peer=peer, error=type(exc).__name__)
                        return
                    last_status = status
                async with condition:
                    # Checked under the lock: a change made while writing is not missed.
                    if self._server_status.get(service, _UNKNOWN) == last_status:
                        await condition.wait()
        finally:
            self.num_watches_by_peer[peer] -= 1
            if not self.num_watches_by_peer[peer]:
                del self.num_watches_by_peer[peer]
            self._watcher_count_by_service[service] -= 1
            if self._watcher_count_by_service[service] == 0:
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]
