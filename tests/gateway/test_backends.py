"""A backend's model of its cache follows the memory service it reports (gateway/backends.py).

The backend's RPCs are replaced by scripted answers: what is tested is what the gateway does with
Health, Load and Info, not the transport.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from gateway.backends import Backend, SharedCaches
from gateway.routing import CacheMatch
from pagedserve.compute.v1 import compute_pb2

BLOCK = [b"b" * 16]


class ScriptedBackend:
    """Health always SERVING; Load and Info answer what the test set last; Info calls counted."""

    def __init__(self) -> None:
        self.memory_service_id = "ms-1"
        self.num_info_calls = 0

    async def Check(self, request: object, timeout: float) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Load(self, request: object, timeout: float) -> compute_pb2.LoadResponse:
        return compute_pb2.LoadResponse(memory_service_id=self.memory_service_id)

    async def Info(self, request: object, timeout: float) -> compute_pb2.InfoResponse:
        self.num_info_calls += 1
        return compute_pb2.InfoResponse(model_name="m", num_kv_blocks=8, memory_service_id=self.memory_service_id)


def _backend(script: ScriptedBackend, caches: SharedCaches) -> Backend:
    backend = Backend("unix:/nonexistent/compute.sock", [], caches=caches)
    backend.stub = backend._health = script  # type: ignore[assignment]
    return backend


def test_a_changed_memory_service_means_new_info_and_a_new_cache_model() -> None:
    async def scenario() -> None:
        script, caches = ScriptedBackend(), SharedCaches()
        backend, sibling = _backend(script, caches), _backend(ScriptedBackend(), caches)
        await backend.poll(1.0)
        await sibling.poll(1.0)
        assert backend.cache is sibling.cache  # both report ms-1: one pool
        backend.cache.insert(BLOCK)
        await backend.poll(1.0)
        assert script.num_info_calls == 1  # same memory service: Info is not asked again
        # A failed request keeps the model of a named memory service (its pool outlives this backend).
        backend.mark_failed("test")
        assert backend.cache.match(BLOCK) == CacheMatch(1, 0)
        await backend.poll(1.0)
        # Its memory service restarted (a new id) between two polls: Info again, a fresh model.
        script.memory_service_id = "ms-2"
        await backend.poll(1.0)
        assert script.num_info_calls == 3 and backend.info.memory_service_id == "ms-2"
        assert backend.cache is not sibling.cache and backend.cache.match(BLOCK) == CacheMatch(0, 0)
        assert sibling.cache.match(BLOCK) == CacheMatch(1, 0)
        # A backend that names no memory service: its own model, forgotten when it fails.
        script.memory_service_id = ""
        backend.mark_failed("test")
        await backend.poll(1.0)
        backend.cache.insert(BLOCK)
        backend.mark_failed("test")
        assert backend.cache.match(BLOCK) == CacheMatch(0, 0)
        await asyncio.gather(backend.close(), sibling.close())

    asyncio.run(scenario())
