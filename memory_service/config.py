"""Typed, validated configuration of the memory service."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.config import ServiceConfig, check_listen
from pagedserve.service_auth import MEMORY_TOKEN_ENV, check_token, load_token

# Most blocks a pool may have. Every block costs the service metadata (~100 bytes) whatever its
# size, so a layout of tiny blocks must not turn a byte budget into millions of records; 2**20
# blocks of 16 tokens hold 16M tokens, beyond any single device's KV cache today.
MAX_NUM_BLOCKS = 1 << 20
# The CPU pool's size when none is given: the least of this cap, a quarter of available memory and
# ``memory_utilization_threshold`` (90%) of free /dev/shm (kv_pool.default_kv_budget). The shm share
# alone could take all of a host's memory, and too small a pool starves a burst of requests (what
# was measured: docs/benchmarks.md, "Figures behind the code's choices"). 2 GiB holds ~45k tokens of
# SmolLM2-135M in float32 and leaves a small host usable. The one constant of that default.
DEFAULT_CPU_KV_CAP_BYTES = 2 << 30
# The disk tier's budget when --kv-disk-dir is given without --kv-disk-bytes.
DEFAULT_KV_DISK_BYTES = 10 << 30


# The fields that size the pool and share it out, beside the layout (block_size) and the device: the
# keywords ``LLM`` passes on to its private memory service.
POOL_FIELDS = ("max_num_blocks", "kv_cache_bytes", "enable_prefix_caching", "memory_utilization_threshold",
               "reserved_fraction", "reserved_min_priority", "kv_disk_dir", "kv_disk_bytes", "kv_host_bytes")


@dataclass(frozen=True)
class MemoryServiceConfig(ServiceConfig):
    """How the memory service listens and sizes its KV pool (metrics and log level: ServiceConfig).

    The pool's block count comes from, in order: ``max_num_blocks``; ``kv_cache_bytes``; else, at the
    first attach (when the layout, and so the bytes per block, is known), on CUDA
    ``memory_utilization_threshold`` times the free GPU memory, on CPU the least of
    ``DEFAULT_CPU_KV_CAP_BYTES``, a quarter of available RAM and ``memory_utilization_threshold``
    times the free /dev/shm space. The size chosen is logged (``kv_pool_sized``).

    Trust (memory_service/service/trust.py): with a token (``auth_token_file``, else
    ``$PAGEDSERVE_MEMORY_TOKEN``), only clients that present it at Attach may name cache namespaces;
    the others are confined to a namespace of their own and ``max_untrusted_client_blocks``. TCP
    (``address``) needs a token: a port reaches beyond this user.

    Tier (memory_service/tier): with ``kv_disk_dir``, cached blocks of trusted clients that sent a
    model fingerprint are written behind to files there (at most ``kv_disk_bytes``, default
    ``DEFAULT_KV_DISK_BYTES``, LRU), and found again after eviction or a restart. With
    ``kv_host_bytes``, a host-RAM tier of that many bytes (LRU) in front of it, or alone without a
    directory: the same blocks are copied there (page-locked memory on a CUDA pool, plain memory on a
    CPU pool), found there first, and lost at a restart (the disk keeps them).
    """

    socket: str | None = None  # Unix socket path (the default transport)
    address: str | None = None  # "host:port": TCP, only when asked for explicitly
    block_size: int = 16
    max_num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    memory_utilization_threshold: float = 0.9
    reserved_fraction: float = 0.0  # share of blocks reserved for priority >= reserved_min_priority
    reserved_min_priority: int = 1
    device: str = "cpu"  # "cpu" or "cuda" / "cuda:N"
    lease_ttl_s: float = 30.0
    # SIGTERM: NOT_SERVING and no new attach at once, then the attached clients' requests in flight
    # (sequences held) get this long to finish, their calls answered, before the service stops.
    drain_timeout_s: float = 30.0
    max_clients: int = 64  # attached clients at once (each compute service is one)
    # Block-table entries one client's live sequences may hold together (None: the whole pool).
    max_blocks_per_client: int | None = None
    # The same for a client without the token, when the service has one (0: it may attach and read
    # statistics, never take a block).
    max_untrusted_client_blocks: int = 0
    auth_token_file: str | None = None  # file holding the token (else $PAGEDSERVE_MEMORY_TOKEN)
    kv_disk_dir: str | None = None  # directory of the disk tier (None: no tier)
    kv_disk_bytes: int | None = None  # its budget (None: DEFAULT_KV_DISK_BYTES)
    kv_host_bytes: int | None = None  # budget of the host-RAM tier (None: no host tier)
    # KV events (memory_service/service/kv_events.py): a ZMQ PUB address (None: no events), the replay
    # socket's (bound; None: no replay) and the topic, the first frame of every message.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    # The token itself: never written out by write_config_file, never in repr or logs.
    auth_token: str | None = field(default=None, repr=False, metadata={"secret": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.address is not None:
            check_listen("address", self.address, allow_unix=False)
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.max_num_blocks is not None and not 1 <= self.max_num_blocks <= MAX_NUM_BLOCKS:
            raise ValueError(f"max_num_blocks must be in [1, {MAX_NUM_BLOCKS}], got {self.max_num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.memory_utilization_threshold <= 1.0:
            raise ValueError(
                f"memory_utilization_threshold must be in (0, 1], got {self.memory_utilization_threshold}"
            )
        if not 0.0 <= self.reserved_fraction < 1.0:
            raise ValueError(f"reserved_fraction must be in [0, 1), got {self.reserved_fraction}")
        if not (math.isfinite(self.lease_ttl_s) and self.lease_ttl_s > 0):
            raise ValueError(f"lease_ttl_s must be a finite number > 0, got {self.lease_ttl_s}")
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {self.max_clients}")
        if self.max_blocks_per_client is not None and self.max_blocks_per_client < 1:
            raise ValueError(f"max_blocks_per_client must be >= 1, got {self.max_blocks_per_client}")
        if self.max_untrusted_client_blocks < 0:
            raise ValueError(f"max_untrusted_client_blocks must be >= 0, got {self.max_untrusted_client_blocks}")
        if self.kv_disk_bytes is not None and self.kv_disk_bytes < 1:
            raise ValueError(f"kv_disk_bytes must be >= 1, got {self.kv_disk_bytes}")
        if self.kv_disk_bytes is not None and self.kv_disk_dir is None:
            raise ValueError("kv_disk_bytes needs kv_disk_dir (the disk tier's directory)")
        if self.kv_disk_dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_disk_dir needs enable_prefix_caching: the tier keeps cached blocks")
        if self.kv_host_bytes is not None and (type(self.kv_host_bytes) is not int or self.kv_host_bytes < 1):
            raise ValueError(f"kv_host_bytes must be an integer >= 1, got {self.kv_host_bytes!r}")
        if self.kv_host_bytes is not None and not self.enable_prefix_caching:
            raise ValueError("kv_host_bytes needs enable_prefix_caching: the tier keeps cached blocks")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a ZMQ address, tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (the events it replays)")
        if self.auth_token is not None:
            check_token(self.auth_token, "auth_token")
        else:
            object.__setattr__(self, "auth_token",
                               load_token(self.auth_token_file, "auth_token_file", env=MEMORY_TOKEN_ENV))
        if self.address is not None and self.auth_token is None:
            raise ValueError(f"address {self.address!r} (TCP) needs a token (auth_token_file or "
                             f"${MEMORY_TOKEN_ENV}): without one any host that reaches the port could "
                             "take blocks and name any tenant's cache namespace")
