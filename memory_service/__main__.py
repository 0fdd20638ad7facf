"""python -m memory_service: run the memory service until SIGINT/SIGTERM, then drain and stop."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pagedserve.config import add_config_flags, add_service_flags, config_from_args
from pagedserve.errors import PreconditionError
from pagedserve.log import configure_logging
from pagedserve.process import die_with_parent, raise_open_files_limit
from pagedserve.test_hooks import read_test_hooks

from memory_service.config import MemoryServiceConfig


# The flags: MemoryServiceConfig's fields (their defaults are the dataclass's).
FLAGS = {
    "socket": "Unix socket path (default: $XDG_RUNTIME_DIR or /tmp/pagedserve-UID, memory.sock)",
    "address": "also listen on TCP host:port (only with a token: --auth-token-file or $PAGEDSERVE_MEMORY_TOKEN)",
    "block_size": "tokens per KV block",
    "max_num_blocks": "blocks in the pool",
    "kv_cache_bytes": "pool size in bytes (if no --max-num-blocks)",
    "enable_prefix_caching": "keep freed full blocks for prefix reuse",
    "memory_utilization_threshold": "share of the device's free memory for the pool when no size is given",
    "reserved_fraction": "share of blocks reserved for high priority",
    "reserved_min_priority": "lowest priority that may use reserved blocks",
    "device": "cpu or cuda[:N]",
    "lease_ttl_s": "seconds of silence before a client's lease expires",
    "drain_timeout_s": "on SIGTERM, seconds the attached clients' requests in flight may take to finish "
                       "(no new attach meanwhile)",
    "max_clients": "clients attached at once",
    "max_blocks_per_client": "block-table entries one client's sequences may hold together (default: the pool)",
    "max_untrusted_client_blocks": "the same for a client without the token, when there is one",
    "kv_disk_dir": "directory of the disk tier: cached blocks are written behind there (files 0600, directory "
                   "0700) and found again after eviction or a restart on the same directory",
    "kv_disk_bytes": "the disk tier's budget in bytes, least recently used blocks dropped beyond it "
                     "(default with --kv-disk-dir: 10 GiB)",
    "kv_host_bytes": "a host-RAM tier of this many bytes in front of the disk tier (or alone, without "
                     "--kv-disk-dir: a second chance for evicted blocks): cached blocks are copied there, "
                     "least recently used dropped beyond it, lost at a restart. Page-locked (pinned) memory "
                     "on a CUDA pool; plain host memory on a CPU pool, where it is an overflow of the pool "
                     "cheaper than recomputing (a pool sized for the compute service, a larger RAM tier)",
    "kv_events_endpoint": "publish KV events (blocks stored, removed, in which medium) in vLLM's format on this "
                          "ZMQ address: tcp://*:PORT binds, tcp://HOST:PORT connects to a subscriber that binds "
                          "(default: none)",
    "kv_events_replay_endpoint": "bind a ZMQ ROUTER here that replays buffered KV event batches from a sequence "
                                 "number (vLLM's replay protocol)",
    "kv_events_topic": "the topic frame of every KV event message",
    "auth_token_file": "file holding the token clients present at Attach ('authorization: Bearer TOKEN'; "
                       "also $PAGEDSERVE_MEMORY_TOKEN): only they may name cache namespaces",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m memory_service",
        description="pagedserve memory service: owns the paged KV pool and all block metadata.",
    )
    add_service_flags(p)
    add_config_flags(p, MemoryServiceConfig, FLAGS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)  # first: see pagedserve.process
    raise_open_files_limit()  # see pagedserve.process: connections are descriptors
    try:
        config = config_from_args(MemoryServiceConfig, args)
        hooks = read_test_hooks()  # the one place the memory service reads them (tests only)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, log_format=args.log_format)
    try:
        return asyncio.run(_serve(config, hooks.pool_creation_delay_s))
    except PreconditionError as exc:  # an unsafe or taken socket path, found before serving
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def _serve(config: MemoryServiceConfig, pool_creation_delay_s: float) -> int:
    from memory_service.service.server import start

    service = await start(config, pool_creation_delay_s=pool_creation_delay_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"memory service listening on {', '.join(service.addresses)}", flush=True)
    await stop.wait()
    await service.drain(config.drain_timeout_s)
    await service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
