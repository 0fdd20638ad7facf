"""The stored responses of the Responses API (``store: true``), per tenant, bounded, expiring.

What ``previous_response_id`` continues and ``GET``/``DELETE /v1/responses/{id}`` read: each
response's body and its conversation as chat messages (``responses_convert``'s ``context``). A
tenant sees only its own (another tenant's id is simply not found), and each tenant has its own
bounds, so one tenant's traffic never evicts another's responses: at most ``max_responses`` and
``max_bytes`` (the bodies' and conversations' JSON) per tenant, the oldest evicted first, each
kept ``ttl_s`` after it was stored.

Why in the gateway's memory, and what that means with several gateway replicas: the gateway is
otherwise stateless, and a shared store (Redis, a database) would be a new dependency and a new
failure for one feature. A response is stored on the replica that answered it; a request naming it
on another replica gets the 400 "not found" a expired one gets. Deployments with several replicas
either route a conversation to one replica (session affinity on the API key or a header), or send
the whole conversation as ``input`` with ``store: false``, which is what the Agents SDK and
langchain do unless told to use ``previous_response_id``. A restart forgets every response.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoreLimits:
    """Per tenant: how many responses, how many bytes of them, and for how long."""

    max_responses: int = 1000
    max_bytes: int = 64 << 20
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_responses < 1 or self.max_bytes < 1 or self.ttl_s <= 0:
            raise ValueError(f"response store limits must be positive, got {self}")


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as GET returns it
    context: list[dict]  # the conversation up to and including it, as chat messages
    num_bytes: int
    expires_at: float


@dataclass
class _TenantResponses:
    by_id: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)  # oldest first
    num_bytes: int = 0


class ResponseStore:
    """Stored responses by tenant and id.

    Args:
        limits: the per-tenant bounds.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._tenants: dict[str, _TenantResponses] = {}

    def put(self, tenant: str, body: dict, context: list[dict]) -> bool:
        """Stores a response (its id is ``body["id"]``); False when it alone is larger than the budget."""
        num_bytes = len(json.dumps(body, separators=(",", ":"))) + len(json.dumps(context, separators=(",", ":")))
        if num_bytes > self.limits.max_bytes:
            return False
        own = self._tenants.setdefault(tenant, _TenantResponses())
        self._expire(own)
        while own.by_id and (len(own.by_id) >= self.limits.max_responses
                             or own.num_bytes + num_bytes > self.limits.max_bytes):
            self._remove(own, next(iter(own.by_id)))
        own.by_id[body["id"]] = StoredResponse(body, context, num_bytes, self.clock() + self.limits.ttl_s)
        own.num_bytes += num_bytes
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response with this id, unless it expired or was evicted or deleted."""
        own = self._tenants.get(tenant)
        if own is None:
            return None
        self._expire(own)
        return own.by_id.get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        own = self._tenants.get(tenant)
        if own is None or response_id not in own.by_id:
            return False
        self._remove(own, response_id)
        return True

    def num_stored(self, tenant: str) -> int:
        own = self._tenants.get(tenant)
        return 0 if own is None else len(own.by_id)

    def _expire(self, own: _TenantResponses) -> None:
        """Drops expired responses, oldest first (insertion order is expiry order: one TTL for all)."""
        now = self.clock()
        while own.by_id and next(iter(own.by_id.values())).expires_at <= now:
            self._remove(own, next(iter(own.by_id)))

    def _remove(self, own: _TenantResponses, response_id: str) -> None:
        own.num_bytes -= own.by_id.pop(response_id).num_bytes
