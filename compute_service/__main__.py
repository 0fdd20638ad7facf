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

from pagedserve.config import add_config_flags, add_service_flags, build_config, read_config_file
from pagedserve.errors import PreconditionError
from pagedserve.log import configure_logging
from pagedserve.process import die_with_parent, exit_skipping_teardown, raise_open_files_limit
from pagedserve.service_auth import TOKEN_ENV
from pagedserve.test_hooks import read_test_hooks

from memory_service.config import MemoryServiceConfig

from compute_service.engine.config import EngineConfig

from compute_service.service.config import ComputeServiceConfig

# The flags: fields of ComputeServiceConfig, then of EngineConfig (their defaults are the dataclasses').
SERVICE_FLAGS = {
    "model": "'default' (SmolLM2-135M-Instruct), a local Hugging Face Llama-family directory or a GGUF file",
    "memory_socket": "the memory service's Unix socket (default: $XDG_RUNTIME_DIR or /tmp/pagedserve-UID, memory.sock)",
    "listen": "host:port or unix:PATH",
    "served_model_name": "model name reported by Info",
    "cache_dir": "where converted models are cached",
    "max_queued_requests": "requests in flight before RESOURCE_EXHAUSTED",
    "max_queued_per_tenant": "of those, the most one tenant may hold (default: 3/4 of max_queued_requests)",
    "shutdown_grace_s": "on SIGTERM, seconds running requests may take to finish",
    "memory_retry_interval_s": "pause between attempts to reach the memory service",
    "memory_ping_interval_s": "how often an idle engine checks the memory service",
    "write_stall_timeout_s": "abort a stream whose client reads nothing for this long, freeing its blocks",
    "max_stream_buffer": "step outputs a stream holds for a slow reader before its request pauses",
    "auth_token_file": f"require this file's token as 'authorization: Bearer TOKEN' on every call but health "
                       f"(also ${TOKEN_ENV}); the gateway sends it with --backend-token-file",
    "memory_token_file": "send this file's token to the memory service (its --auth-token-file; also "
                         "$PAGEDSERVE_MEMORY_TOKEN): only then may this service name cache namespaces there",
    "grammar_compile_timeout_s": "CPU seconds one structured-output constraint may compile before it is refused",
    "grammar_compile_threads": "worker processes that compile structured-output constraints",
    "grammar_compiles_per_tenant": "compiles one tenant may have running at once (its others wait)",
    "grammar_probe_max_fill_s": "CPU seconds one token mask may take when a new grammar is probed",
    "grammar_cache_size": "compiled structured-output constraints kept for reuse",
}
# EngineConfig fields that a service sets (the pool's own settings belong to the memory service).
ENGINE_FLAGS = {
    "max_num_seqs": "sequences running at once",
    "max_num_batched_tokens": "new tokens per engine step",
    "block_size": "tokens per KV block; must equal the memory service's",
    "num_speculative_tokens": "n-gram speculative drafts per greedy sequence and step, at most (0 = off)",
    "mask_fill_timeout_s": "a constrained request whose token mask takes longer than this fails alone (error)",
    "mask_fill_max_cpu_s": "... or whose token mask takes more CPU seconds than this",
    "device": "cpu or cuda[:N] (default: cuda when available)",
    "dtype": "auto, float32, float16 or bfloat16 (auto: bfloat16 on CUDA and on CPUs with native bf16, "
             "AMX-BF16 or AVX512-BF16; float32 on other CPUs)",
    "quantization": "auto, none, int8 or int4: the weights kept quantized and computed on, on the CPU (auto: a "
                    "GGUF file's quantized tensors as they are, a float checkpoint unquantized; int8/int4: "
                    "quantized at load)",
}
_ENGINE_FIELDS = tuple(ENGINE_FLAGS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m compute_service",
        description="pagedserve compute service: runs the model with continuous batching over the "
                    "memory service's paged KV pool; gRPC service pagedserve.compute.v1.Compute.",
    )
    add_service_flags(p)
    add_config_flags(p, ComputeServiceConfig, SERVICE_FLAGS)
    add_config_flags(p, EngineConfig, ENGINE_FLAGS)
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
    raise_open_files_limit()  # see pagedserve.process: connections are descriptors
    try:
        service, engine = configs_from_args(args)
        hooks = read_test_hooks()  # the one place the compute service reads them (tests only)
        configure_logging(service.log_level, log_format=args.log_format)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from compute_service.engine.faults import DetokenizeFault
    from compute_service.service.server import serve  # torch and the model code load only to serve

    try:
        fault = DetokenizeFault.from_entries(hooks.detokenize_fault)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"error: test hook detokenize_fault: {exc!r}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(service, engine, fault))
    except PreconditionError as exc:  # an unsafe or taken --listen socket, found before serving
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    status = main()
    if status == 0:  # a clean stop: no module teardown (see exit_skipping_teardown)
        exit_skipping_teardown(status)
    sys.exit(status)
