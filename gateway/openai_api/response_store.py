"""The stored responses of the Responses API (``store: true``), per tenant, bounded, expiring.

What ``previous_response_id`` continues and ``GET``/``DELETE /v1/responses/{id}`` read: each
response's body and its conversation as chat messages (``responses_convert``'s ``context``). A
tenant sees only its own (another tenant's id is simply not found): the store is keyed by the
tenant's ``namespace`` (a keyed digest of its API keys), not its name, which for plain keys is a
list position (``key-1``) that a new key in that position would inherit with the old key's
responses. Each tenant has its own bounds, so one tenant's traffic never evicts another's
responses within them: at most ``max_responses`` and ``max_bytes`` (the bodies' and
conversations' JSON) per tenant, the oldest evicted first, each kept ``ttl_s`` after it was
stored. Above them all, ``max_total_bytes`` bounds the gateway's memory whatever the number of
tenants: past it, the tenant holding the most bytes loses its oldest response (the heaviest user
pays for the room, not whoever stored least recently).

Expiry is swept on every put and get, for all tenants at once, in constant time per expired
response: one TTL for all, so the order of storing is the order of expiry, and one ordered map of
every response (``_all``) has the next to expire first.

A response larger than a tenant's ``max_bytes`` (or the total) is not stored: ``put`` says so and
the endpoint answers it with ``store: false`` and logs it, so a client never learns of it from a
later 404.

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
    """Per tenant: how many responses, how many bytes of them, and for how long; and the bytes of
    all tenants' together."""

    max_responses: int = 1000
    max_bytes: int = 64 << 20
    ttl_s: float = 3600.0
    max_total_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.max_responses < 1 or self.max_bytes < 1 or self.ttl_s <= 0 or self.max_total_bytes < 1:
            raise ValueError(f"response store limits must be positive, got {self}")


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as GET returns it
    context: list[dict]  # the conversation up to and including it, as chat messages
    num_bytes: int
    expires_at: float


def stored_bytes(body: dict, context: list[dict]) -> int:
    """What a response takes in the store: its body's and conversation's compact JSON. Megabytes
    of JSON take tens of milliseconds: call it off the event loop."""
    return len(json.dumps(body, separators=(",", ":"))) + len(json.dumps(context, separators=(",", ":")))


@dataclass
class _TenantResponses:
    by_id: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)  # oldest first
    num_bytes: int = 0


class ResponseStore:
    """Stored responses by tenant and id.

    Args:
        limits: the per-tenant and total bounds.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._tenants: dict[str, _TenantResponses] = {}
        # Every tenant's responses, oldest (so first to expire) first: (tenant, id) -> expiry.
        self._all: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.num_bytes = 0  # of all tenants

    def put(self, tenant: str, body: dict, context: list[dict], num_bytes: int) -> bool:
        """Stores a response (its id is ``body["id"]``), evicting older ones to make room.

        Args:
            tenant: the tenant's namespace.
            num_bytes: ``stored_bytes(body, context)`` (measured by the caller, off the event loop).
        Returns:
            False, storing nothing, when it alone is larger than a tenant's or the total budget.
        """
        self._expire()
        if num_bytes > min(self.limits.max_bytes, self.limits.max_total_bytes):
            return False
        own = self._tenants.setdefault(tenant, _TenantResponses())
        while own.by_id and (len(own.by_id) >= self.limits.max_responses
                             or own.num_bytes + num_bytes > self.limits.max_bytes):
            self._remove(tenant, next(iter(own.by_id)))
        while self.num_bytes + num_bytes > self.limits.max_total_bytes:
            heaviest = max((t for t in self._tenants if self._tenants[t].by_id),
                           key=lambda t: self._tenants[t].num_bytes)
            self._remove(heaviest, next(iter(self._tenants[heaviest].by_id)))
        stored = StoredResponse(body, context, num_bytes, self.clock() + self.limits.ttl_s)
        own.by_id[body["id"]] = stored
        own.num_bytes += num_bytes
        self.num_bytes += num_bytes
        self._all[(tenant, body["id"])] = stored.expires_at
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response with this id, unless it expired or was evicted or deleted."""
        self._expire()
        own = self._tenants.get(tenant)
        return None if own is None else own.by_id.get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forgets the tenant's response with this id.

        Returns:
            Whether it was stored (False: never stored, another tenant's, expired, evicted or deleted).
        """
        own = self._tenants.get(tenant)
        if own is None or response_id not in own.by_id:
            return False
        self._remove(tenant, response_id)
        return True

    def num_stored(self, tenant: str) -> int:
        """How many responses the tenant has stored (expired ones not yet swept included)."""
        own = self._tenants.get(tenant)
        return 0 if own is None else len(own.by_id)

    def _expire(self) -> None:
        """Drops every tenant's expired responses, oldest first (insertion order is expiry order)."""
        now = self.clock()
        while self._all and next(iter(self._all.values())) <= now:
            self._remove(*next(iter(self._all)))

    def _remove(self, tenant: str, response_id: str) -> None:
        own = self._tenants[tenant]
        num_bytes = own.by_id.pop(response_id).num_bytes
        own.num_bytes -= num_bytes
        self.num_bytes -= num_bytes
        del self._all[(tenant, response_id)]
        if not own.by_id:
            del self._tenants[tenant]  # a tenant without responses holds no entry
