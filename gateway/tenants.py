"""Tenants: who an API key says the caller is, and what its operator lets it do.

A tenant is who the key says it is. Everything security-relevant is derived from the tenant, never
from what a request claims: its concurrency share, the highest priority it may ask for, and the
prefix-cache namespace its prompts live in (derived from its keys: `Tenant.namespace`). Logs and
metrics name the tenant, never its key.

This module knows nothing of gRPC or HTTP, so every front (the gRPC servicer, an OpenAI HTTP front)
shares one model through two calls: ``Tenants.identify(bearer_token)`` (which tenant is it; None:
not a key of ours) and ``Tenants.admit(tenant)`` (hold a slot until ``Admission.release``).

Where tenants come from (``load_tenants``): ``--api-keys-file`` holds either a JSON object,
``{"tenants": {"team-a": {"keys": ["..."], "max_priority": 5, "max_concurrent": 64,
"max_requests_per_s": 20}}}``, or one
key per line; keys given one per line, in ``PAGEDSERVE_API_KEYS`` (comma-separated) or in a JSON
config's ``api_keys`` list are tenants of their own, named ``key-1``, ``key-2``, ... in that order.
Defaults: ``max_priority`` 0 (the operator grants more), ``max_concurrent`` a fair share of the
gateway, ``max(1, max_queued_requests // number of tenants)``; ``max_requests_per_s`` none (a
tenant given one may send that many requests a second, in bursts of a second's worth, on both
fronts: ``Tenants.charge``; beyond, RESOURCE_EXHAUSTED / 429 before the request is read, so a flood of
requests that would each be refused costs the engine's cores next to nothing). Without any key there is one
tenant, ``local``, with no limits beyond the gateway's own (priorities and the reserved pool work
as for a single user).

Why keys are matched through an HMAC: the token's digest (under a key drawn at start) is compared
with every key's digest by ``hmac.compare_digest``, with no early exit. Equal-length digests mean
the comparison time says neither how much of a guess was right, which key it was close to, nor how
long the keys are.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.errors import PermissionDeniedError, ResourceExhaustedError

LOCAL_TENANT = "local"
# Tenant names appear in logs, metric labels and error messages: short, plain, unambiguous.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A key travels as "authorization: Bearer KEY": printable ASCII without spaces.
_KEY = re.compile(r"[\x21-\x7e]{1,256}")
_TENANT_FIELDS = {"keys", "max_priority", "max_concurrent", "max_requests_per_s"}
_NAMESPACE_MESSAGE = b"pagedserve prefix-cache namespace v1"


@dataclass(frozen=True)
class Tenant:
    """One tenant and the operator's limits on it.

    Args:
        name: what logs, metrics and cache namespaces see.
        max_priority: the highest request priority it may ask for (None: any).
        max_concurrent: requests it may hold in the gateway at once (None: the gateway's limit only).
        keys: its API keys (never printed: not in repr).
        max_requests_per_s: requests it may send a second, in bursts of a second's worth (None: any).
    """

    name: str
    max_priority: int | None = 0
    max_concurrent: int | None = None
    keys: tuple[str, ...] = field(default=(), repr=False, compare=False)
    max_requests_per_s: float | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tenant name {self.name[:80]!r}: 1-64 characters of A-Z a-z 0-9 . _ -, "
                             "starting with a letter or digit")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"tenant {self.name!r}: max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.max_requests_per_s is not None and not self.max_requests_per_s > 0:
            raise ValueError(f"tenant {self.name!r}: max_requests_per_s must be > 0, got {self.max_requests_per_s}")

    def check_priority(self, priority: int) -> None:
        """Refuses a priority above the tenant's maximum (never clamps it silently).

        Raises:
            PermissionDeniedError: ``priority`` exceeds ``max_priority``.
        """
        if self.max_priority is not None and priority > self.max_priority:
            raise PermissionDeniedError(f"priority {priority} is above the max_priority of tenant {self.name!r} "
                                        f"({self.max_priority}); ask the operator for more")

    @functools.cached_property
    def namespace(self) -> str:
        """What the tenant's prefix-cache namespace derives from: its keys, never its name.

        Plain keys are named by list position (``key-1``) and the disk tier keeps namespaces across
        restarts, so a namespace of the name let a new key in the first position read the cached
        prompts of the revoked key that stood there. A keyed digest of each key
        (HMAC-SHA256 under the key itself: stable across restarts, and no key can be learnt from it),
        all of a tenant's keys together: adding or removing a key starts the tenant on a new,
        empty namespace. Only the keyless local tenant is named by its name.
        """
        if not self.keys:
            return self.name
        digests = sorted(hmac.new(key.encode(), _NAMESPACE_MESSAGE, hashlib.sha256).hexdigest() for key in self.keys)
        return "keys-" + hashlib.sha256("\n".join(digests).encode()).hexdigest()

    def cache_salt(self, client_salt: str) -> str:
        """The prefix-cache namespace of a request: the tenant's, narrowed by the client's salt.

        A digest, so no client salt of one tenant can name another tenant's namespace; the
        newline cannot occur in a namespace, so (namespace, salt) pairs never collide.
        """
        digest = hashlib.sha256(f"{self.namespace}\n{client_salt}".encode()).hexdigest()
        return f"tenant-{digest}"


def _plain_name(i: int) -> str:
    return f"key-{i}"


def _check_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"{where}: each key must be a string of 1-256 printable ASCII characters without spaces")
    return key


def _int_field(spec: dict, name: str, tenant: str, where: str) -> int | None:
    if name not in spec:
        return None
    value = spec[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: tenant {tenant!r}: {name} must be an integer, got {type(value).__name__}")
    return value


def _rate_field(spec: dict, name: str, tenant: str, where: str) -> float | None:
    value = spec.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{where}: tenant {tenant!r}: {name} must be a number, got {type(value).__name__}")
    return value


_Spec = tuple[str, list[str], int | None, int | None, float | None]


def parse_tenants_json(data: object, where: str) -> list[_Spec]:
    """(name, keys, max_priority, max_concurrent, max_requests_per_s) of each tenant of a JSON tenants file.

    Raises:
        ValueError: the shape is wrong; the message names the tenant and field, never a key.
    """
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
        raise ValueError(f'{where}: a JSON key file must be {{"tenants": {{"NAME": {{"keys": [...], ...}}}}}}')
    found = []
    for name, spec in data["tenants"].items():
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: tenant {name!r} must be an object")
        unknown = sorted(set(spec) - _TENANT_FIELDS)
        if unknown:
            raise ValueError(f"{where}: tenant {name!r} has unknown field(s) {unknown}; "
                             f"known: {sorted(_TENANT_FIELDS)}")
        keys = spec.get("keys")
        if not isinstance(keys, list) or not keys:
            raise ValueError(f"{where}: tenant {name!r}: keys must be a non-empty list of strings")
        found.append((name, [_check_key(k, f"{where}: tenant {name!r}") for k in keys],
                      _int_field(spec, "max_priority", name, where), _int_field(spec, "max_concurrent", name, where),
                      _rate_field(spec, "max_requests_per_s", name, where)))
    if not found:
        raise ValueError(f"{where}: names no tenant")
    return found


def load_tenants(plain_keys: Sequence[str], file_text: str | None, where: str,
                 max_queued_requests: int) -> tuple[Tenant, ...]:
    """The tenants of a gateway (empty: no key configured, local use).

    Args:
        plain_keys: keys that are tenants of their own (config ``api_keys``, the environment).
        file_text: the ``--api-keys-file`` contents (JSON object, or one key per line), or None.
        where: how error messages name the file.
        max_queued_requests: the gateway's limit, shared out as the default ``max_concurrent``.
    Raises:
        ValueError: a malformed file, a bad key, a name or a key given twice.
    """
    specs: list[_Spec] = []
    plain = [_check_key(k, "api_keys or PAGEDSERVE_API_KEYS") for k in plain_keys]
    if file_text is not None:
        if file_text.lstrip().startswith("{"):
            try:
                data = json.loads(file_text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            specs += parse_tenants_json(data, where)
        else:
            lines = [line.strip() for line in file_text.splitlines()]
            from_file = [_check_key(k, where) for k in lines if k and not k.startswith("#")]
            if not from_file:
                raise ValueError(f"{where} holds no key")
            plain += from_file
    specs += [(_plain_name(i), [key], None, None, None) for i, key in enumerate(plain, start=1)]
    if not specs:
        return ()
    share = max(1, max_queued_requests // len(specs))
    tenants, names, keys = [], set(), set()
    for name, tenant_keys, max_priority, max_concurrent, max_requests_per_s in specs:
        if name in names:
            raise ValueError(f"{where}: tenant {name!r} is named twice")
        for key in tenant_keys:
            if key in keys:
                raise ValueError(f"{where}: a key of tenant {name!r} is given twice")
            keys.add(key)
        names.add(name)
        try:
            tenants.append(Tenant(name, 0 if max_priority is None else max_priority,
                                  share if max_concurrent is None else max_concurrent, tuple(tenant_keys),
                                  max_requests_per_s))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return tuple(tenants)


class Admission:
    """One admitted request's hold on a gateway slot and on its tenant's; released exactly once.

    ``release`` is idempotent, so every exit path (finish, abort, error) may call it.
    """

    def __init__(self, tenants: Tenants, tenant: Tenant) -> None:
        self.tenant = tenant
        self._tenants = tenants
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._tenants._release(self.tenant)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Tenants:
    """Key lookup and admission for every front of one gateway.

    Args:
        tenants: the configured tenants (empty: no keys, one ``local`` tenant, no key needed).
        max_in_flight: requests the gateway holds at once, whatever the tenant.
        on_change: called with (tenant name, its requests now) after every admit and release
            (metrics).
    """

    def __init__(self, tenants: Sequence[Tenant], max_in_flight: int,
                 on_change: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requires_key = bool(tenants)
        self.local = Tenant(LOCAL_TENANT, max_priority=None, max_concurrent=None)
        self.tenants = tuple(tenants) or (self.local,)
        self.max_in_flight = max_in_flight
        # With several tenants, one holds at most 3/4 of the gateway (whatever its max_concurrent):
        # the rest stays for the others, so one tenant's burst never gets a newcomer refused. The
        # compute service keeps the same share of its queue (docs/design.md, "Fair admission").
        self.max_per_tenant = max_in_flight - max_in_flight // 4 if len(self.tenants) > 1 else max_in_flight
        self.num_in_flight = 0
        self.num_active = {t.name: 0 for t in self.tenants}
        self._on_change = on_change or (lambda _name, _count: None)
        self._hmac_key = secrets.token_bytes(32)
        self._digests = [(self._digest(k.encode()), t) for t in tenants for k in t.keys]
        self._clock = clock
        self._rate_lock = threading.Lock()  # the gRPC and HTTP fronts run on threads of their own
        self._allowance: dict[str, tuple[float, float]] = {}  # tenant -> (requests it may send now, as of)

    def _digest(self, token: bytes) -> bytes:
        return hmac.new(self._hmac_key, token, hashlib.sha256).digest()

    def identify(self, token: str | bytes | None) -> Tenant | None:
        """The tenant whose key ``token`` is (the local tenant when no keys are configured).

        Every key's digest is compared, in constant time each, whichever matches.
        Returns:
            The tenant, or None when keys are required and ``token`` is none of them.
        """
        if not self.requires_key:
            return self.local
        if not token:
            token = b""
        digest = self._digest(token.encode("latin-1", "replace") if isinstance(token, str) else token)
        found = None
        for key_digest, tenant in self._digests:
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found if token else None

    def charge(self, tenant: Tenant) -> None:
        """Counts one request of ``tenant`` against its ``max_requests_per_s`` (a token bucket of a
        second's worth, at least one request); call as soon as the key is known, before the body is
        read or converted.

        Raises:
            ResourceExhaustedError: the tenant has sent its share; the message says when to retry.
        """
        rate = tenant.max_requests_per_s
        if rate is None:
            return
        burst = max(1.0, rate)
        with self._rate_lock:
            now = self._clock()
            allowance, as_of = self._allowance.get(tenant.name, (burst, now))
            allowance = min(burst, allowance + (now - as_of) * rate)
            if allowance < 1.0:
                self._allowance[tenant.name] = (allowance, now)
                raise ResourceExhaustedError(
                    f"tenant {tenant.name!r} sends more than its max_requests_per_s ({rate:g} a second); "
                    f"retry in {(1.0 - allowance) / rate:.2f} s")
            self._allowance[tenant.name] = (allowance - 1.0, now)

    def admit(self, tenant: Tenant) -> Admission:
        """Holds a slot for one request of ``tenant`` (synchronously: call before any await).

        Raises:
            ResourceExhaustedError: the gateway, or the tenant, is at its limit.
        """
        return self.admit_many(tenant, 1)[0]

    def admit_many(self, tenant: Tenant, count: int) -> list[Admission]:
        """Holds ``count`` slots for ``tenant``, all or none (one HTTP request's list of prompts).

        Checked before the requests are even converted: a list far beyond the tenant's free slots
        costs one comparison.
        Raises:
            ResourceExhaustedError: the gateway, or the tenant, has fewer than ``count`` slots free.
        """
        asked = "" if count == 1 else f" and this request asks for {count} more"
        if self.num_in_flight + count > self.max_in_flight:
            raise ResourceExhaustedError(f"the gateway holds {self.num_in_flight} requests "
                                         f"(max_queued_requests){asked}; retry later")
        active = self.num_active.get(tenant.name, 0)
        if tenant.max_concurrent is not None and active + count > tenant.max_concurrent:
            raise ResourceExhaustedError(f"tenant {tenant.name!r} holds {active} requests, its max_concurrent "
                                         f"({tenant.max_concurrent}){asked}; retry later")
        if active + count > self.max_per_tenant:
            raise ResourceExhaustedError(f"tenant {tenant.name!r} holds {active} requests, its share of the gateway "
                                         f"(3/4 of max_queued_requests: {self.max_per_tenant}){asked}; retry later")
        self.num_in_flight += count
        self.num_active[tenant.name] = active + count
        self._on_change(tenant.name, active + count)
        return [Admission(self, tenant) for _ in range(count)]

    def _release(self, tenant: Tenant) -> None:
        self.num_in_flight -= 1
        self.num_active[tenant.name] -= 1
        self._on_change(tenant.name, self.num_active[tenant.name])
