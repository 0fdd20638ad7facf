"""Who a memory service is, and what it keeps below its pool: what its clients report upstream.

Compute services attached to one memory service share its pool (and the tiers below it): a prefix
that one of them cached is a cache hit for every other. A gateway cannot learn that from its own
routing history, so the service names itself at Attach (``AttachResponse.memory_service_id``), each
compute service reports that name in its ``Info``, and the gateway treats backends with the same
name as one cache (gateway/backend/routing.py).

The id is random, made when the service starts. With a tier directory it is kept there instead
(``memory-service-id``), because the directory is what outlives a restart: a new service on the same
directory finds yesterday's blocks, so it is, for routing, the same cache. A file that is not a
well-formed id (torn, edited) is replaced by a new one, and one that cannot be written (a full
disk) is not kept: a wrong id only costs affinity, never correctness, since the id predicts hits and
decides nothing about which KV is served, so neither stops the service from starting.

The same cache, but not the same pool: a restarted service's pool starts empty, and yesterday's
blocks are only in its tier. So each start also makes an epoch (``AttachResponse.memory_service_epoch``,
random, never kept), reported beside the id: the gateway that sees the id again under a new epoch
moves its prediction of that pool's blocks to the tier.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from memory_service.tier.disk_tier import open_own_file
from pagedserve.log import get_logger

log = get_logger("memory_service.identity")

ID_FILE_NAME = "memory-service-id"
_ID_PATTERN = re.compile(r"ms-[0-9a-f]{32}")
TIER_KINDS = ("host", "disk")


@dataclass(frozen=True)
class KvTierInfo:
    """A tier below the pool, as clients are told of it.

    Args:
        kind: "host" (pinned host RAM) or "disk".
        capacity_bytes: bytes of block data it may hold (> 0).
    """

    kind: str
    capacity_bytes: int

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise ValueError(f"kind must be one of {TIER_KINDS}, got {self.kind!r}")
        if type(self.capacity_bytes) is not int or self.capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {self.capacity_bytes!r}")


def new_service_id() -> str:
    """A fresh id: 128 random bits, so two services never share one by chance."""
    return f"ms-{secrets.token_hex(16)}"


def new_epoch() -> str:
    """This start's epoch: 64 random bits, never kept (module docstring)."""
    return secrets.token_hex(8)


def _read_id_file(id_file: Path) -> str | None:
    """The kept id's text, or None: only from a regular file of ours, never through a link, at most a
    page (a symlink to /dev/zero read to a MemoryError, a FIFO hung the start)."""
    try:
        with open_own_file(id_file) as f:
            return f.read(4096).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return None
    except OSError:  # not a file of ours (NotOurFile), or unreadable: replaced by a fresh id
        return ""


def service_id(directory: str | Path | None) -> str:
    """This service's id: a fresh one, or, given a tier directory, the one kept there (made on first use).

    Args:
        directory: the tier's directory (created 0700 if missing), or None when there is no tier.
    """
    if directory is None:
        return new_service_id()
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    id_file = path / ID_FILE_NAME
    kept = _read_id_file(id_file)
    if kept is not None and _ID_PATTERN.fullmatch(kept):
        return kept
    if kept is not None:
        log.warning("memory_service_id_replaced", path=str(id_file), reason="not a well-formed id")
    fresh = new_service_id()
    # Written whole under another name, then renamed: a crash leaves the old file or the new one.
    tmp = path / f".{ID_FILE_NAME}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)  # a leftover of an earlier start with this pid (or a planted name)
        # Created exclusively, never through a link: a planted symlink under this name was followed and
        # its target overwritten.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(fresh + "\n")
        os.replace(tmp, id_file)
    except OSError as exc:  # a full (or failing) disk must not stop the service: the id is this start's only
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        log.warning("memory_service_id_not_kept", path=str(id_file), error=exc.strerror,
                    reason="the id could not be written; a restart on this directory gets a new one")
    return fresh
