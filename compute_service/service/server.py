"""Run the compute service: a grpc.aio server in front of the engine loop thread.

Life cycle:
1. The server starts at once, NOT_SERVING (a probe gets an answer while the model loads).
2. The model loads in a worker thread; the engine loop thread then attaches to the memory service
   (retrying until it answers) and the health turns SERVING.
3. Memory service lost: NOT_SERVING, requests in flight end UNAVAILABLE, the loop re-attaches by
   itself (new lease, new pool mapping) and the health turns SERVING again.
4. SIGTERM/SIGINT: NOT_SERVING for good, new requests UNAVAILABLE, running ones get
   ``shutdown_grace_s`` to finish (then they are cancelled), the loop detaches (lease released);
   the process has exited ``shutdown_grace_s + drain.COMPUTE_STOP_S`` after the signal at the latest.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from grpc_health.v1 import health_pb2

from pagedserve import rpc, sampling_rules, sockets
from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.drain import COMPUTE_STOP_S
from pagedserve.dtypes import dtype_name
from pagedserve.errors import UnavailableError
from pagedserve.log import get_logger
from pagedserve.process import check_health
from pagedserve.service_auth import TokenInterceptor
from pagedserve.trace_context import tracer_for

from memory_service.api import KvLayout, MemoryClient

from compute_service.engine.config import EngineConfig

from compute_service.service.config import ComputeServiceConfig
from compute_service.structured.grammar_compiler import GrammarCompiler, GrammarCompilerConfig, ProbeConfig
from compute_service.structured.logits_mask import num_abandoned_fills
from compute_service.engine.engine import Engine
from compute_service.engine.faults import DetokenizeFault
from compute_service.service.engine_loop import Attached, EngineLoop
from compute_service.model.model_info import ModelInfo, model_info
from compute_service.model.model_loader import LoadedModel, load_model
from compute_service.service.request_traces import RequestSpans
from compute_service.service.servicer import ComputeServicer

log = get_logger("compute_service")

SERVICE_NAME = compute_pb2.DESCRIPTOR.services_by_name["Compute"].full_name
# The Attach call's deadline. Not the retry interval: the first attach creates the pool (seconds a
# GiB on a CPU), and a deadline that passes mid-creation leaves that client attached with nobody
# behind it until its lease expires, while the retry attaches a second one.
ATTACH_TIMEOUT_S = 300.0


def memory_target(config: ComputeServiceConfig) -> str:
    return f"unix:{config.memory_socket or sockets.default_socket_path()}"


def make_grammar_compiler(loaded: LoadedModel, config: ComputeServiceConfig) -> GrammarCompiler | None:
    """One constraint compiler per model (it outlives engines rebuilt on re-attach); None without a tokenizer."""
    if loaded.tokenizer is None:
        return None
    return GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids,
                           GrammarCompilerConfig(num_threads=config.grammar_compile_threads,
                                                 timeout_s=config.grammar_compile_timeout_s,
                                                 cache_size=config.grammar_cache_size,
                                                 max_jobs_per_tenant=config.grammar_compiles_per_tenant,
                                                 probe=ProbeConfig(max_fill_s=config.grammar_probe_max_fill_s)))


def make_attach(loaded: LoadedModel, target: str, engine_config: EngineConfig,
                timeout_s: float, grammars: GrammarCompiler | None = None,
                memory_token: str | None = None,
                detokenize_fault: DetokenizeFault | None = None) -> Callable[[], Attached]:
    """The engine loop's way to (re)attach: a fresh lease, pool mapping and Engine per call;
    ``memory_token`` is the memory service's token (memory_service/service/trust.py);
    ``detokenize_fault`` a test hook for each engine (engine/faults.py)."""
    layout = KvLayout(
        num_layers=loaded.config.num_layers, num_kv_heads=loaded.config.num_kv_heads,
        head_dim=loaded.config.head_dim, dtype=dtype_name(loaded.model.dtype),
        block_size=engine_config.block_size,
    )
    fingerprint = loaded.fingerprint  # keys the memory service's KV tier

    def attach() -> Attached:
        # Probe first (the probe closes its channel): a dead service costs no half-open client.
        if check_health(target, timeout_s=max(timeout_s, 0.2)) != health_pb2.HealthCheckResponse.SERVING:
            raise UnavailableError(f"memory service at {target} is not serving")
        memory = MemoryClient(target, layout, client_name="compute", connect_timeout_s=max(timeout_s, 1.0),
                              attach_timeout_s=ATTACH_TIMEOUT_S, token=memory_token, model_fingerprint=fingerprint)
        try:
            engine = Engine(loaded.model, loaded.config, loaded.tokenizer, memory, engine_config, grammars,
                            detokenize_fault)
            return Attached(engine, memory)
        except BaseException:
            memory.close()
            raise

    return attach


def _load(config: ComputeServiceConfig, engine_config: EngineConfig) -> tuple[LoadedModel, ModelInfo]:
    """The model and its description, which loads (or builds) the kernels it runs: both at start, in a
    worker thread. A CPU model on the slower PyTorch path is said loudly here (and in Info, metrics)."""
    loaded = load_model(config.model, cache_dir=Path(config.cache_dir) if config.cache_dir else None,
                        device=engine_config.device, dtype=engine_config.dtype,
                        quantization=engine_config.quantization)
    info = model_info(loaded, config.served_model_name)
    if info.kernels == "torch-fallback":
        log.error("compute_kernels", kernels=info.kernels, device=info.device, dtype=info.dtype,
                  why="no usable fused CPU kernels (see the kernels.cpu_ops error above)")
    else:
        log.info("compute_kernels", kernels=info.kernels, device=info.device, dtype=info.dtype,
                 paths=dict(info.kernel_paths))
    return loaded, info


async def serve(config: ComputeServiceConfig, engine_config: EngineConfig,
                detokenize_fault: DetokenizeFault | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status. ``detokenize_fault``: a test hook
    (pagedserve/test_hooks.py), given to every engine."""
    event_loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        event_loop.add_signal_handler(sig, stop.set)

    servicer = ComputeServicer(config, engine_config)
    # Only the gateways may call (they derive salts, priorities and ids from their callers' keys).
    auth = [TokenInterceptor(config.auth_token)] if config.auth_token else []
    # Sized from the limits of a request (its prompt at most MAX_PROMPT_TOKENS ids, every repeated
    # field bounded), not a flat 64 MiB: a request far beyond any model's is refused before parsing.
    server, health = rpc.create_aio_server(
        [lambda s: compute_pb2_grpc.add_ComputeServicer_to_server(servicer, s)], [SERVICE_NAME], serving=False,
        max_message_bytes=sampling_rules.max_message_bytes(), extra_interceptors=auth,
    )
    address = sockets.bind(server, config.listen)
    await server.start()
    sockets.secure_socket(address)
    print(f"compute service listening on {address}", flush=True)
    log.info("compute_service_started", address=address, model=config.model, auth=bool(config.auth_token))

    loading = asyncio.ensure_future(asyncio.to_thread(_load, config, engine_config))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await server.stop(0)
        _remove_socket(address)
        return 0
    try:
        loaded, info = loading.result()
    except ValueError as exc:  # load_model's one kind of bad input: the model (a path, an architecture, a GGUF type)
        log.error("model_load_failed", model=config.model, error=str(exc))
        print(f"error: --model: {exc}", file=sys.stderr, flush=True)
        await server.stop(0)
        _remove_socket(address)
        return 2

    async def set_ready(ready: bool) -> None:
        servicer.is_ready = ready
        if not servicer.is_draining:
            await health.set_serving(ready)
        log.info("compute_service_ready" if ready else "compute_service_not_ready")

    def on_ready(ready: bool) -> None:  # engine thread
        asyncio.run_coroutine_threadsafe(set_ready(ready), event_loop)

    grammars = make_grammar_compiler(loaded, config)
    loop = EngineLoop(
        make_attach(loaded, memory_target(config), engine_config, config.memory_retry_interval_s, grammars,
                    config.memory_token, detokenize_fault),
        on_ready, retry_interval_s=config.memory_retry_interval_s, ping_interval_s=config.memory_ping_interval_s,
    )
    tracer = tracer_for(config.otlp_traces_endpoint, "pagedserve-compute")  # None (nothing imported) when off
    if tracer is not None:
        loop.request_spans = RequestSpans(tracer)
    servicer.start(loop, info, grammars)
    loop.start()
    if config.metrics_port is not None:
        from compute_service.service.metrics import start_metrics_server

        start_metrics_server(config.metrics_host, config.metrics_port, loop, servicer)

    await stopping
    await drain(servicer, health, config.shutdown_grace_s)
    # Within drain.COMPUTE_STOP_S from here (the chart's grace period counts on it).
    await server.stop(1.0)  # streams still open are cancelled: their requests are aborted
    # Detaches: the memory service frees what is left (a detach cut short: the lease's TTL does it).
    await asyncio.to_thread(loop.stop, COMPUTE_STOP_S - 2)
    _remove_socket(address)
    if grammars is not None:
        grammars.close()  # its worker processes (a compile in progress is killed)
    if tracer is not None:
        await asyncio.to_thread(tracer.shutdown)  # the spans still batched
    log.info("compute_service_stopped")
    if num_abandoned_fills():
        # A mask fill past its deadline still runs in C++: interpreter finalization would destroy
        # the grammar engine under it (std::terminate, SIGABRT). Everything is shut down and
        # flushed, so leave without finalizing.
        log.warning("mask_fills_abandoned", num_fills=num_abandoned_fills())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


async def drain(servicer: ComputeServicer, health: rpc.AioHealth, grace_s: float) -> None:
    """Stop taking requests and give the running ones up to ``grace_s`` to finish."""
    servicer.is_draining = True
    await health.shut_down()
    log.info("compute_service_draining", num_streams=servicer.num_streams, grace_s=grace_s)
    deadline = asyncio.get_running_loop().time() + grace_s
    while servicer.num_streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def _remove_socket(address: str) -> None:
    """A stopped server leaves its Unix socket file behind: remove it."""
    if address.startswith("unix:"):
        Path(address.removeprefix("unix:")).unlink(missing_ok=True)
