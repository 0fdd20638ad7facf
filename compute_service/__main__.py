"""python -m compute_service: serve a model over gRPC until SIGTERM/SIGINT."""

from __future__ import annotations

if __name__ == "__main__":
    # tcmalloc + Intel OpenMP when both are installed (pagedserve/cpu_preload.py): a re-exec of this
    # same process, before torch is imported below.
    from pagedserve import cpu_preload

    cpu_preload.maybe_reexec("compute_service")

import argparse
import asyncio
import dataclasses
import sys

from pagedserve.config import add_config_file_flag, build_config, read_config_file
from pagedserve.errors import PreconditionError
from pagedserve.log import add_log_format_flag, configure_logging
from pagedserve.process import add_parent_pid_flag, die_with_parent
from pagedserve.service_auth import TOKEN_ENV

from memory_service.config import MemoryServiceConfig

from compute_service.engine.config import EngineConfig

from compute_service.service.config import DEFAULT_LISTEN, ComputeServiceConfig

# EngineConfig fields that a service sets (the pool's own settings belong to the memory service).
_ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "device", "dtype")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m compute_service",
        description="pagedserve compute service: runs the model with continuous batching over the "
                    "memory service's paged KV pool; gRPC service pagedserve.compute.v1.Compute.",
    )
    add_config_file_flag(p)
    p.add_argument("--model", help="'default' (SmolLM2-135M-Instruct) or a local Hugging Face Llama-family directory")
    p.add_argument("--memory-socket", dest="memory_socket",
                   help="the memory service's Unix socket (default: $XDG_RUNTIME_DIR or /tmp/pagedserve-UID, memory.sock)")
    p.add_argument("--listen", help=f"host:port or unix:PATH (default {DEFAULT_LISTEN})")
    p.add_argument("--served-model-name", dest="served_model_name", help="model name reported by Info")
    p.add_argument("--cache-dir", dest="cache_dir", help="where converted models are cached")
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, help="sequences running at once (default 64)")
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int,
                   help="new tokens per engine step (default 2048)")
    p.add_argument("--max-queued-requests", dest="max_queued_requests", type=int,
                   help="requests in flight before RESOURCE_EXHAUSTED (default 256)")
    p.add_argument("--block-size", dest="block_size", type=int,
                   help="tokens per KV block; must equal the memory service's (default 16)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--dtype", help="float32, float16 or bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--shutdown-grace-s", dest="shutdown_grace_s", type=float,
                   help="on SIGTERM, seconds running requests may take to finish (default 30)")
    p.add_argument("--memory-retry-interval-s", dest="memory_retry_interval_s", type=float,
                   help="pause between attempts to reach the memory service (default 0.5)")
    p.add_argument("--memory-ping-interval-s", dest="memory_ping_interval_s", type=float,
                   help="how often an idle engine checks the memory service (default 1)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", dest="metrics_host", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--write-stall-timeout-s", dest="write_stall_timeout_s", type=float,
                   help="abort a stream whose client reads nothing for this long, freeing its blocks (default 30)")
    p.add_argument("--max-stream-buffer", dest="max_stream_buffer", type=int,
                   help="step outputs a stream holds for a slow reader before its request pauses (default 8)")
    p.add_argument("--auth-token-file", dest="auth_token_file",
                   help=f"require this file's token as 'authorization: Bearer TOKEN' on every call but health "
                        f"(also ${TOKEN_ENV}); the gateway sends it with --backend-token-file")
    p.add_argument("--log-level", dest="log_level", help="debug, info, warning, error")
    add_log_format_flag(p)
    p.add_argument("--grammar-compile-timeout-s", dest="grammar_compile_timeout_s", type=float,
                   help="longest compile of one structured-output constraint before it is refused (default 5)")
    p.add_argument("--grammar-compile-threads", dest="grammar_compile_threads", type=int,
                   help="threads that compile structured-output constraints (default 2)")
    add_parent_pid_flag(p)
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[ComputeServiceConfig, EngineConfig]:
    """Both configs from ``--config`` overridden by the flags given.

    One file may configure the memory service too (``pagedserve up --config`` gives both the same
    file): the memory service's own keys are ignored here, except ``socket``, which is where that
    service listens and so the default of ``memory_socket``.
    """
    file_values = read_config_file(args.config) if args.config else {}
    service_names = {f.name for f in dataclasses.fields(ComputeServiceConfig)}
    memory_only = {f.name for f in dataclasses.fields(MemoryServiceConfig)} - service_names - set(_ENGINE_FIELDS)
    if "socket" in file_values and "memory_socket" not in file_values:
        file_values["memory_socket"] = file_values["socket"]
    file_values = {k: v for k, v in file_values.items() if k not in memory_only}
    unknown = sorted(set(file_values) - service_names - set(_ENGINE_FIELDS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known keys: {sorted(service_names | set(_ENGINE_FIELDS))}")
    flags = vars(args)
    service = build_config(ComputeServiceConfig, {k: v for k, v in file_values.items() if k in service_names}, flags)
    engine_values = {k: v for k, v in file_values.items() if k in _ENGINE_FIELDS}
    engine = build_config(EngineConfig, engine_values, {k: flags.get(k) for k in _ENGINE_FIELDS})
    engine = dataclasses.replace(engine, memory_socket=service.memory_socket)
    return service, engine


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)  # first: see pagedserve.process
    try:
        service, engine = configs_from_args(args)
        configure_logging(service.log_level, log_format=args.log_format)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from compute_service.service.server import serve  # torch and the model code load only to serve

    try:
        return asyncio.run(serve(service, engine))
    except PreconditionError as exc:  # an unsafe or taken --listen socket, found before serving
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
