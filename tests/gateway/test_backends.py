"""A backend's model of its cache follows the memory service it reports (gateway/backend/pool.py).

The backend's RPCs are replaced by scripted answers: what is tested is what the gateway does with
Health, Load and Info, not the transport.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from gateway.backend.pool import Backend, SharedCaches
from gateway.backend.routing import CacheMatch
from pagedserve.compute.v1 import compute_pb2

BLOCK = [b"b" * 16]


class ScriptedBackend:
    """Health always SERVING; Load and Info answer what the test set last; Info calls counted."""

    def __init__(self, epoch: str = "", tier_blocks: int = 0, host_tier_blocks: int = 0, pool_blocks: int = 8) -> None:
        self.memory_service_id = "ms-1"
        self.pool_blocks = pool_blocks
        self.epoch = epoch
        self.tier_blocks = tier_blocks  # a disk tier's
        self.host_tier_blocks = host_tier_blocks
        self.is_attached = True  # False: between two leases (NOT_SERVING, no pool), as the real one
        self.num_info_calls = 0

    async def Check(self, request: object, timeout: float) -> health_pb2.HealthCheckResponse:
        status = health_pb2.HealthCheckResponse
        return status(status=status.SERVING if self.is_attached else status.NOT_SERVING)

    async def Load(self, request: object, timeout: float) -> compute_pb2.LoadResponse:
        if not self.is_attached:
            return compute_pb2.LoadResponse()
        return compute_pb2.LoadResponse(memory_service_id=self.memory_service_id, memory_service_epoch=self.epoch)

    async def Info(self, request: object, timeout: float) -> compute_pb2.InfoResponse:
        self.num_info_calls += 1
        if not self.is_attached:
            return compute_pb2.InfoResponse(model_name="m")
        tiers = [compute_pb2.KvTier(kind=kind, capacity_blocks=blocks)
                 for kind, blocks in (("host", self.host_tier_blocks), ("disk", self.tier_blocks)) if blocks]
        return compute_pb2.InfoResponse(model_name="m", num_kv_blocks=self.pool_blocks,
                                        memory_service_id=self.memory_service_id,
                                        memory_service_epoch=self.epoch, kv_tiers=tiers)


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


def test_a_memory_service_restarted_under_its_id_has_its_pool_hits_demoted_to_tier_hits() -> None:
    """A memory service with a tier keeps its id across a restart, but its pool starts empty: the
    new epoch it reports makes the model forget the pool's blocks, which stay predicted in the tier."""
    async def scenario() -> None:
        script, caches = ScriptedBackend("e1", tier_blocks=64), SharedCaches()
        sibling_script = ScriptedBackend("e1", tier_blocks=64)
        backend, sibling = _backend(script, caches), _backend(sibling_script, caches)
        await backend.poll(1.0)
        await sibling.poll(1.0)
        assert backend.cache is sibling.cache
        backend.cache.insert(BLOCK)
        assert backend.cache.match(BLOCK) == CacheMatch(1, 0)
        # Restarted between two polls (the compute service re-attached): same id, new epoch.
        script.epoch = "e2"
        await backend.poll(1.0)
        assert script.num_info_calls == 2 and backend.cache is sibling.cache
        assert backend.cache.match(BLOCK) == CacheMatch(0, 1)  # a tier hit now, not a pool hit
        # Routed after the restart: in the pool. The sibling, not re-attached yet, still reports the
        # old epoch when it rejoins: not another restart.
        later = [b"c" * 16]
        backend.cache.insert(later)
        sibling.mark_failed("test")
        await sibling.poll(1.0)
        assert sibling.cache.match(later) == CacheMatch(1, 0)
        sibling_script.epoch = "e2"  # it re-attached: the epoch the model knows
        await sibling.poll(1.0)
        assert sibling_script.num_info_calls == 3 and sibling.cache.match(later) == CacheMatch(1, 0)
        # Restarted again, and this time polled while the compute services re-attach (NOT_SERVING,
        # an Info that names no pool): the memory service's model outlives it, then is demoted.
        for s in (script, sibling_script):
            s.is_attached = False
        for _ in range(2):
            await asyncio.gather(backend.poll(1.0), sibling.poll(1.0))
        assert not backend.is_healthy and backend.cache is sibling.cache
        for s in (script, sibling_script):
            s.is_attached, s.epoch = True, "e3"
        await asyncio.gather(backend.poll(1.0), sibling.poll(1.0))
        assert backend.is_healthy and backend.cache is sibling.cache
        assert backend.cache.match(later) == CacheMatch(0, 1)
        await asyncio.gather(backend.close(), sibling.close())

    asyncio.run(scenario())


def test_a_restart_keeps_only_the_tier_blocks_its_disk_tier_holds() -> None:
    """The host-RAM tier (--kv-host-bytes) is empty after a restart, as the pool is; the disk tier
    keeps its newest blocks up to its capacity. So a new epoch leaves predicted (as tier hits) only
    the newest blocks the disk tier holds, and none without a disk tier."""
    blocks = [[bytes([i]) * 16] for i in range(6)]  # six one-block prompts, routed in this order

    async def restarted(script: ScriptedBackend) -> list[CacheMatch]:
        backend = _backend(script, SharedCaches())
        await backend.poll(1.0)
        for block in blocks:
            backend.cache.insert(block)
        assert [backend.cache.match(b) for b in blocks] == [CacheMatch(0, 1)] * 2 + [CacheMatch(1, 0)] * 4
        script.epoch = "e2"
        await backend.poll(1.0)
        assert script.num_info_calls == 2
        await backend.close()
        return [backend.cache.match(b) for b in blocks]

    async def scenario() -> None:
        # Before each restart: a pool of 4 blocks holds the 4 newest, the tier model all 6.
        # A host tier of 6 blocks in front of a disk tier of 3: the 3 newest survive, as tier hits.
        assert await restarted(ScriptedBackend("e1", tier_blocks=3, host_tier_blocks=6, pool_blocks=4)) == (
            [CacheMatch(0, 0)] * 3 + [CacheMatch(0, 1)] * 3)
        # A host tier only: nothing survives.
        assert await restarted(ScriptedBackend("e1", host_tier_blocks=6, pool_blocks=4)) == [CacheMatch(0, 0)] * 6
        # A disk tier larger than what was routed: everything survives, as tier hits.
        assert await restarted(ScriptedBackend("e1", tier_blocks=64, pool_blocks=4)) == [CacheMatch(0, 1)] * 6

    asyncio.run(scenario())
