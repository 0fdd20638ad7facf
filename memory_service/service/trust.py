"""Who may name a cache namespace: the memory service's token and what a client without it may do.

Why: the prefix cache shares a block between every sequence of one namespace once its client
commits it (memory_service/manager/prefix_cache.py). A client that names another tenant's namespace
and commits blocks it never wrote serves that tenant garbage as cached prompt tokens; a client that
allocates without limit holds the whole pool. The compute services derive namespaces from the
gateways' tenants, so they are trusted; any other process that reaches the socket (or the TCP port)
is not.

The rule, when the service has a token (``--auth-token-file`` or ``$PAGEDSERVE_MEMORY_TOKEN``):

- A client that presents it at Attach (``authorization: Bearer TOKEN``, sent by the compute service
  and ``LLM``) is *trusted*: any namespace, at most ``max_blocks_per_client`` block-table entries.
  Every later call naming its ``client_id`` must carry the token too (UNAUTHENTICATED otherwise), so
  a client id seen in a log is no way in.
- Any other client is *untrusted*. It may attach, keep its lease, call Stats, Ping and
  CheckIntegrity, and step its own sequences, with these limits: an AllocateOp must leave
  ``namespace`` empty (the default); any other value refuses the whole Step with PERMISSION_DENIED
  and changes nothing. Its empty namespace is a namespace of its own (``private_namespace``): its
  blocks are shared between its own sequences only, never with another client, and it never gets a
  hit on another client's blocks. It holds at most ``max_untrusted_client_blocks`` block-table
  entries (default 0: no block at all); beyond that its ops fail as out of blocks.

Without a token every client is trusted, as before: the Unix socket is owner-only (0600), so the
boundary is this user, and TCP is refused at start (a port reaches other users and hosts).

What the token does not guard: the pool's bytes. A process that maps the pool (its shared-memory
segment is owner-only too) can write any block; the token guards the block metadata that decides
who reads what, so a process of another user, or one that reaches the service over TCP, cannot
poison a tenant's cache or starve the pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagedserve.errors import PermissionDeniedError
from pagedserve.service_auth import token_matches

from memory_service.manager.block_types import AllocateOp, Op

# Prefix of an untrusted client's own namespace. Trusted clients' namespaces come from
# ``cache_namespace`` ("<len>:<model>|<salt digest>"), which never starts with it.
PRIVATE_NAMESPACE_PREFIX = "untrusted-client:"


def is_trusted(service_token: str | None, offered: bytes) -> bool:
    """Whether a caller that offered ``offered`` as its Bearer token is trusted (see the module
    docstring): always without a service token, else only with that token (constant time)."""
    return service_token is None or token_matches(offered, service_token)


def private_namespace(client_id: str) -> str:
    """The namespace an untrusted client's sequences live in: its own, shared with nobody."""
    return PRIVATE_NAMESPACE_PREFIX + client_id


def confine(client_id: str, ops: Sequence[Op], field: str = "ops") -> list[Op]:
    """An untrusted client's ops with its AllocateOps moved to its private namespace.

    Args:
        client_id: the untrusted client.
        ops: its ops, in order.
        field: the Step's field that carried them (for the error message).

    Raises:
        PermissionDeniedError: an AllocateOp names a namespace (nothing is applied).
    """
    confined: list[Op] = []
    namespace = private_namespace(client_id)
    for index, op in enumerate(ops):
        if type(op) is AllocateOp:
            if op.namespace:
                raise PermissionDeniedError(
                    f"{field}[{index}].namespace: naming a cache namespace needs the memory service's token; "
                    "leave it empty (a namespace of this client's own)")
            op = dataclasses.replace(op, namespace=namespace)
        confined.append(op)
    return confined
