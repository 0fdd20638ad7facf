"""``pagedserve up``: memory, compute and gateway as three supervised processes on one machine.

The memory and compute services talk over Unix sockets in a private (0700) runtime directory made
for this run and removed at the end; only the gateway listens on TCP. So the compute service needs
no service token here: only this user reaches its socket (with ``PAGEDSERVE_COMPUTE_TOKEN`` set,
both the compute service and the gateway inherit it, and use it). The memory service does get a
token, made fresh for the run (pagedserve/stack.py): only this run's compute service may name cache
namespaces in it (memory_service/service/trust.py). ``up`` stops all three when
it is interrupted (Ctrl-C, SIGTERM) or when any one of them dies, gateway first (no new requests),
memory service last (it owns the KV pool's shared memory, which it unlinks as it exits).

The stop is a drain, one service after the other: each gets SIGTERM only once the one in front of it
has exited, and ``--drain-timeout-s`` (each service's own drain flag) to finish what it holds, so a
stream in flight at Ctrl-C completes through all three (the gateway waits for it, and the compute
and memory services behind it are still serving). Each is waited for at most its bound
(pagedserve/drain.py, ``stop_bound_s``), so ``up`` has exited within the sum of the three. The
services run in process groups of their own (pagedserve/process.py): a terminal's Ctrl-C reaches
``up`` alone, which keeps that order.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1 import health_pb2

from pagedserve.config import add_config_flags
from pagedserve.drain import stop_bound_s
from pagedserve.log import LOG_FORMATS
from pagedserve.process import ServiceProcess, check_health
from pagedserve.sockets import free_port
from pagedserve.stack import Stack, StackConfig, shm_segments

SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class PassThrough:
    """A service flag that ``pagedserve up`` passes on: named, typed, explained and validated by the
    service's own config dataclass and flag table, never typed again here.

    Args:
        service: "memory" (``MemoryServiceConfig``, memory_service/__main__.py's FLAGS), "compute"
            (``EngineConfig``, compute_service/__main__.py's ENGINE_FLAGS) or "gateway"
            (``GatewayConfig``, gateway/__main__.py's FLAGS).
        field: the config field; the flag is the service's own, ``--field-name``.
        env: an environment variable that gives the flag's default, if any.
        is_path: a file or directory: passed as an absolute path (the service may not share ``up``'s
            working directory, and the value names the same place on every run).
    """

    service: str
    field: str
    env: str | None = None
    is_path: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


# What ``up`` passes through, one line each. Not given, a flag is not passed: the service's
# default, or the --config file's value, holds. The KV tier's directory outlives the run (unlike
# the run's sockets), so a new ``up`` on the same directory finds the blocks of the last one.
PASS_THROUGH = (
    PassThrough("memory", "kv_cache_bytes", env="PAGEDSERVE_KV_CACHE_BYTES"),
    PassThrough("memory", "kv_disk_dir", is_path=True),
    PassThrough("memory", "kv_disk_bytes"),
    PassThrough("memory", "kv_host_bytes"),
    PassThrough("compute", "dtype"),
    PassThrough("compute", "quantization"),
    PassThrough("gateway", "tool_call_parser"),
)
# What a service's config needs besides the checked field to be built at all (``UpConfig`` checks
# a value by building the config): a gateway needs a backend, which ``up`` gives it at start.
_REQUIRED_FIELDS: dict[str, dict[str, Any]] = {"gateway": {"backends": ("unix:up",)}}


def _service_schema(service: str) -> tuple[type, Mapping[str, str]]:
    """A service's config dataclass and its flags' help texts (imported only when ``up`` needs them)."""
    if service == "memory":
        from memory_service.__main__ import FLAGS
        from memory_service.config import MemoryServiceConfig

        return MemoryServiceConfig, FLAGS
    if service == "gateway":
        from gateway.__main__ import FLAGS as GATEWAY_FLAGS
        from gateway.config import GatewayConfig

        return GatewayConfig, GATEWAY_FLAGS
    from compute_service.__main__ import ENGINE_FLAGS
    from compute_service.engine.config import EngineConfig

    return EngineConfig, ENGINE_FLAGS


def add_pass_through_flags(parser: argparse.ArgumentParser) -> None:
    """``up``'s flags for ``PASS_THROUGH``, each derived from its service's config field."""
    for item in PASS_THROUGH:
        cls, helps = _service_schema(item.service)
        help_text = f"{helps[item.field]}; passed to the {item.service} service"
        if item.env is not None:
            help_text += f" (default ${item.env})"
        add_config_flags(parser, cls, {item.field: help_text})
        if os.environ.get(item.env or ""):
            parser.set_defaults(**{item.field: os.environ[item.env]})  # parsed with the flag's type


def _flag_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class UpConfig:
    """What ``pagedserve up`` starts.

    Args:
        model: "default", a local Hugging Face model directory or a GGUF file.
        host: the gateway's bind host (both fronts).
        port: the gateway's gRPC port (0 = any free port).
        http_port: its OpenAI-compatible HTTP port (0 = any free port).
        service_flags: values of ``PASS_THROUGH`` fields (``kv_cache_bytes``, ``dtype``, ...) for the
            services; a field absent or None is not passed (the service's default or --config holds).
        config_file: JSON config passed to the memory and compute services.
        ready_timeout_s: how long each service may take to become SERVING (model conversion included).
        log_format: the services' log lines, "json" or "console" (None: console when ``up`` itself
            writes to a terminal, JSON otherwise; the services' own output is never a terminal
            test, since they inherit ``up``'s).
        drain_timeout_s: on Ctrl-C or SIGTERM, how long each service may drain (the gateway's
            ``--grace-period-s``, the compute service's ``--shutdown-grace-s``, the memory service's
            ``--drain-timeout-s``).
    """

    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    service_flags: Mapping[str, Any] = field(default_factory=dict)
    config_file: str | None = None
    ready_timeout_s: float = 600.0
    log_format: str | None = None
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s}")
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        if self.log_format not in (None, *LOG_FORMATS):
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        known = {item.field: item for item in PASS_THROUGH}
        unknown = sorted(set(self.service_flags) - set(known))
        if unknown:
            raise ValueError(f"service_flags: {unknown} are not passed through; known: {sorted(known)}")
        # The service's own validation, of each service's values together (some rules join two:
        # kv_disk_bytes needs kv_disk_dir); an error names the flag of the value it names.
        for service in sorted({item.service for item in PASS_THROUGH}):
            given = {name: value for name, value in self.service_flags.items()
                     if value is not None and known[name].service == service}
            if not given:
                continue
            cls, _ = _service_schema(service)
            try:
                cls(**_REQUIRED_FIELDS.get(service, {}), **given)
            except ValueError as exc:
                flags = [known[name].flag for name in given if name in str(exc)] or [known[n].flag for n in given]
                raise ValueError(f"{', '.join(flags)}: {exc}") from None


def _say(text: str, *, end: str = "\n") -> None:
    print(f"pagedserve: {text}", end=end, file=sys.stderr, flush=True)


def _wait_serving(service: ServiceProcess, what: str, timeout_s: float, stop: list[bool]) -> None:
    """Waits for SERVING, showing the elapsed time (the compute service loads a model meanwhile)."""
    started = time.monotonic()
    shown = -1
    while check_health(service.address, service.health_service, timeout_s=1.0) != SERVING:
        if not service.is_running():
            raise RuntimeError(f"{service.module} exited with status {service.returncode} while {what}")
        if stop[0]:
            raise KeyboardInterrupt
        elapsed = int(time.monotonic() - started)
        if elapsed > timeout_s:
            raise RuntimeError(f"{service.module} was not ready after {timeout_s:.0f} s")
        if elapsed >= 2 and elapsed % 5 == 0 and elapsed != shown:
            _say(f"{what} ... {elapsed} s")
            shown = elapsed
        time.sleep(0.1)


def grpcurl_hint(address: str) -> str:
    """A ready-to-paste grpcurl command for the gateway at ``address``."""
    body = ('{"messages":[{"role":"user","content":"What is the capital of France?"}],'
            '"params":{"max_tokens":32,"temperature":0}}')
    return f"grpcurl -plaintext -d '{body}' {address} pagedserve.gateway.v1.Gateway/Generate"


def curl_hint(host: str, port: int) -> str:
    """A ready-to-paste curl command for the gateway's OpenAI-compatible HTTP API."""
    body = '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32,"temperature":0}'
    return (f"curl http://{_url_host(host)}:{port}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}'")


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def stack_config(config: UpConfig, log_format: str, http_port: int) -> StackConfig:
    """The stack ``up`` starts: its services' output inherited, so their logs show with ``up``'s."""
    shared = ("--log-format", log_format, *(("--config", config.config_file) if config.config_file else ()))
    passed: dict[str, list[str]] = {"memory": [], "compute": [], "gateway": []}
    for item in PASS_THROUGH:
        value = config.service_flags.get(item.field)
        if value is not None:
            if item.is_path:
                value = os.path.abspath(os.path.expanduser(str(value)))
            passed[item.service] += [item.flag, _flag_value(value)]
    drain = _flag_value(config.drain_timeout_s)
    return StackConfig(model=config.model, memory_args=(*passed["memory"], "--drain-timeout-s", drain, *shared),
                       compute_args=(*passed["compute"], "--shutdown-grace-s", drain, *shared),
                       gateway_args=("--http-port", str(http_port), "--log-format", log_format,
                                     "--grace-period-s", drain, *passed["gateway"]),
                       gateway_host=config.host, gateway_port=config.port, log_to_files=False,
                       ready_timeout_s=config.ready_timeout_s)


def run_up(config: UpConfig) -> int:
    """Starts the stack and supervises it; returns 0 after a requested stop, 1 when a service died.

    The first Ctrl-C (or SIGTERM) drains the services in order (``drain_stack``); a second one does
    not wait any more: every service still running is killed at once, and the memory service's
    shared-memory pool removed after it."""
    stop = [False]
    started: list[Stack] = []

    def on_signal(*_: object) -> None:
        if stop[0]:  # the second one
            _say("a second signal: killing the services without draining them")
            for stack in started:
                for service in stack.services:
                    service.send_signal(signal.SIGKILL)
        stop[0] = True

    # Installed before anything starts, so an early Ctrl-C still stops what was started.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The services write to up's stderr but cannot tell whether a person reads it: up decides.
    log_format = config.log_format or ("console" if sys.stderr.isatty() else "json")
    http_port = config.http_port or free_port(config.host)
    stack = Stack(stack_config(config, log_format, http_port))  # a fresh 0700 runtime directory, removed by stop()
    started.append(stack)
    status = 0
    try:
        _wait_serving(stack.spawn_memory(), "starting the memory service", config.ready_timeout_s, stop)
        _say(f"memory service ready (unix:{stack.memory_socket})")
        _wait_serving(stack.spawn_compute(), f"loading model {config.model!r} in the compute service",
                      config.ready_timeout_s, stop)
        _say("compute service ready")
        gateway = stack.spawn_gateway()
        _wait_serving(gateway, "starting the gateway", config.ready_timeout_s, stop)
        address = gateway.address
        print(f"\npagedserve is up: gateway on {address}, OpenAI-compatible HTTP API on "
              f"http://{_url_host(config.host)}:{http_port}/v1 (model {config.model})\n"
              f"  pagedserve generate --address {address} \"What is the capital of France?\"\n"
              f"  {grpcurl_hint(address)}\n"
              f"  {curl_hint(config.host, http_port)}\n"
              f"Ctrl-C stops all three services.\n", flush=True)
        while not stop[0]:
            dead = [s for s in stack.services if not s.is_running()]
            if dead:
                _say(f"{dead[0].module} exited with status {dead[0].returncode}; stopping the others")
                status = 1
                break
            time.sleep(0.2)
    except RuntimeError as exc:
        _say(f"error: {exc}")
        status = 1
    except KeyboardInterrupt:
        pass
    finally:
        drain_stack(stack, config.drain_timeout_s)
        _say("stopped")
    return status


def drain_stack(stack: Stack, drain_timeout_s: float) -> None:
    """Stops the services one after the other, gateway first, each given its drain bound before it is
    killed (``ServiceProcess.stop``), then removes the runtime directory; says how long each took."""
    for service in reversed(stack.services):
        started = time.monotonic()
        status = service.stop(timeout_s=stop_bound_s(service.module, drain_timeout_s))
        _say(f"{service.module} stopped ({time.monotonic() - started:.1f} s)")
        if status == -signal.SIGKILL and service.module == "memory_service":
            for segment in shm_segments(service.pid):  # a killed memory service could not remove its pool
                segment.unlink(missing_ok=True)
    stack.stop()  # the services are gone: the directory and its sockets
