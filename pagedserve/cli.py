"""The ``pagedserve`` command: ``up`` starts the local stack, ``generate`` sends a prompt."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pagedserve.rpc import default_socket_path


def _wait_for_socket(path: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if proc.poll() is not None:
            raise RuntimeError(f"memory service exited with status {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise RuntimeError(f"memory service did not create {path} within {timeout_s:.0f} s")
        time.sleep(0.05)


def cmd_up(args: argparse.Namespace) -> int:
    """Start the services as child processes and supervise them until Ctrl-C or SIGTERM."""
    socket = args.socket or default_socket_path()
    memory_cmd = [sys.executable, "-m", "memory_service", "--socket", socket]
    if args.config:
        memory_cmd += ["--config", args.config]
    if args.kv_cache_bytes:
        memory_cmd += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    children = [subprocess.Popen(memory_cmd)]
    try:
        _wait_for_socket(socket, children[0], timeout_s=60)
        print(f"pagedserve: memory service on unix:{socket}", flush=True)
        stop = False

        def on_signal(*_: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not stop:
            for child in children:
                if child.poll() is not None:
                    print(f"pagedserve: {child.args[2]} exited with status {child.returncode}", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the whole stack locally with the default model")
    up.add_argument("--config", help="JSON config file shared by the services")
    up.add_argument("--socket", help="memory service Unix socket path")
    up.add_argument(
        "--kv-cache-bytes", type=int, default=int(os.environ.get("PAGEDSERVE_KV_CACHE_BYTES", 512 << 20)),
        help="KV pool size in bytes (default 512 MiB)",
    )
    up.set_defaults(func=cmd_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
