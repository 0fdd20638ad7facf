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
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    # Installed before anything starts, so an early SIGTERM still stops the children cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children = [subprocess.Popen(memory_cmd)]
    try:
        _wait_for_socket(socket, children[0], timeout_s=60)
        print(f"pagedserve: memory service on unix:{socket}", flush=True)
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


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate in this process, attached to the running memory service when there is one.

    The KV pool (and its prefix cache) lives in the memory service, so a second call with the same
    prompt prefix reuses the first call's blocks even though this process is new.
    """
    from compute_service import LLM, SamplingParams

    socket = args.socket or default_socket_path()
    attach = Path(socket).exists()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    with LLM(args.model, memory_socket=socket if attach else None) as llm:
        if args.raw:
            out = llm.generate([args.prompt], params)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], sampling_params=params)
    print(out.text)
    print(
        f"[{len(out.prompt_token_ids)} prompt tokens ({out.num_cached_tokens} from the prefix cache), "
        f"{len(out.token_ids)} generated, finish_reason={out.finish_reason}, "
        f"memory service: {'attached at ' + socket if attach else 'private'}]",
        file=sys.stderr,
    )
    return 0


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
    gen = sub.add_parser("generate", help="send one prompt (chat template applied unless --raw)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="default", help="'default' or a local Hugging Face model directory")
    gen.add_argument("--socket", help="memory service socket to attach to (default: the one `pagedserve up` uses)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
