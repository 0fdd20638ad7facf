"""API-key auth for the gRPC front: ``authorization: Bearer KEY`` metadata names the tenant.

Which tenant a key is, and the constant-time match, live in ``gateway.tenants`` (shared with every
front); this interceptor only refuses calls whose key is no tenant's. Health checks and reflection
stay open, so load balancers, Kubernetes probes and ``grpcurl list`` work without a key.
"""

from __future__ import annotations

from gateway.tenants import Tenants
from pagedserve.service_auth import BearerInterceptor, bearer_token

__all__ = ["ApiKeyInterceptor", "bearer_token"]


class ApiKeyInterceptor(BearerInterceptor):
    """Rejects calls without a tenant's key with UNAUTHENTICATED (health and reflection exempt).

    Args:
        tenants: the gateway's tenants (with keys).
    """

    open_prefixes = ("/grpc.health.v1.Health/", "/grpc.reflection.")
    rejection = "missing or invalid API key (authorization: Bearer KEY)"

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

    def accepts(self, offered: bytes) -> bool:
        return self._tenants.identify(offered) is not None
