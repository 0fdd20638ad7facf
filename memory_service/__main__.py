"""python -m memory_service: run the memory service until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pagedserve.config import add_config_file_flag, config_from_args
from pagedserve.errors import PreconditionError
from pagedserve.log import add_log_format_flag, configure_logging
from pagedserve.process import add_parent_pid_flag, die_with_parent

from memory_service.config import MemoryServiceConfig


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m memory_service",
        description="pagedserve memory service: owns the paged KV pool and all block metadata.",
    )
    add_config_file_flag(p)
    p.add_argument("--socket", help="Unix socket path (default: $XDG_RUNTIME_DIR or /tmp/pagedserve-UID, memory.sock)")
    p.add_argument("--address", help="also listen on TCP host:port (only when asked for)")
    p.add_argument("--block-size", dest="block_size", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-blocks", dest="max_num_blocks", type=int, help="blocks in the pool")
    p.add_argument("--kv-cache-bytes", dest="kv_cache_bytes", type=int, help="pool size in bytes (if no --max-num-blocks)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", type=_bool, help="true/false (default true)")
    p.add_argument(
        "--memory-utilization-threshold", dest="memory_utilization_threshold", type=float,
        help="share of the device's free memory for the pool when no size is given (default 0.9)",
    )
    p.add_argument("--reserved-fraction", dest="reserved_fraction", type=float, help="share of blocks reserved for high priority")
    p.add_argument("--reserved-min-priority", dest="reserved_min_priority", type=int, help="lowest priority that may use reserved blocks")
    p.add_argument("--device", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--lease-ttl-s", dest="lease_ttl_s", type=float, help="seconds of silence before a client's lease expires")
    p.add_argument("--metrics-port", dest="metrics_port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--metrics-host", dest="metrics_host",
        help="bind address of the metrics server (default 127.0.0.1; it has no authentication)",
    )
    p.add_argument("--max-clients", dest="max_clients", type=int, help="clients attached at once (default 64)")
    p.add_argument("--log-level", dest="log_level", help="debug, info, warning, error")
    add_log_format_flag(p)
    add_parent_pid_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)  # first: see pagedserve.process
    try:
        config = config_from_args(MemoryServiceConfig, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, log_format=args.log_format)
    try:
        return asyncio.run(_serve(config))
    except PreconditionError as exc:  # an unsafe or taken socket path, found before serving
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def _serve(config: MemoryServiceConfig) -> int:
    from memory_service.service.server import start

    service = await start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"memory service listening on {', '.join(service.addresses)}", flush=True)
    await stop.wait()
    await service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
