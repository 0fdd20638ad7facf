"""The gateway's configuration: one typed, self-validating dataclass (flags and JSON file fill it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve import sampling_rules

# Where API keys come from besides --api-keys-file: comma-separated keys.
API_KEYS_ENV = "PAGEDSERVE_API_KEYS"


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class GatewayConfig:
    """How one gateway listens, finds its backends, routes and protects itself.

    Args:
        backends: compute services: ``host:port``, ``unix:PATH`` or ``dns:NAME:PORT`` (every
            address NAME resolves to, re-resolved every ``dns_refresh_s``).
        listen: the public address, ``host:port``.
        metrics_port: Prometheus HTTP port (None = no metrics server; 0 = any free port).
        metrics_host: the metrics server's bind address.
        api_keys_file: one key per line (blank lines and ``#`` comments ignored).
        max_queued_requests: requests this gateway holds at once (waiting for or streaming from a
            backend); one more is answered RESOURCE_EXHAUSTED at once.
        health_interval_s: how often each backend's health and load are polled.
        dns_refresh_s: how often ``dns:`` backends are resolved again.
        grace_period_s: after SIGTERM, how long in-flight streams may take to finish.
        drain_delay_s: after SIGTERM, how long the gateway still takes new requests while it
            reports NOT_SERVING (the time load balancers need to notice and stop sending).
        max_prompt_chars: longest prompt (or sum of message contents) accepted.
        max_messages: most chat messages accepted.
        max_message_bytes: largest gRPC request accepted (grpc answers RESOURCE_EXHAUSTED beyond).
        affinity_max_blocks: leading prompt blocks hashed for prefix affinity.
        affinity_max_load_gap: affinity yields when its backend's outstanding tokens exceed the
            least loaded backend's by more than this ...
        affinity_max_load_ratio: ... and by more than this factor (both must hold, as in SGLang's
            router: a small absolute gap or a small ratio is noise, not imbalance).
        log_prompts: put prompt text into access log lines (off: prompts are user data).
    """

    backends: tuple[str, ...] = ()
    listen: str = "127.0.0.1:50051"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    api_keys_file: str | None = None
    max_queued_requests: int = 1024
    health_interval_s: float = 1.0
    dns_refresh_s: float = 10.0
    grace_period_s: float = 30.0
    drain_delay_s: float = 0.0
    max_prompt_chars: int = sampling_rules.MAX_PROMPT_CHARS
    max_messages: int = sampling_rules.MAX_MESSAGES
    max_message_bytes: int = 4 << 20
    affinity_max_blocks: int = 32
    affinity_max_load_gap: int = 4096
    affinity_max_load_ratio: float = 2.0
    log_prompts: bool = False
    api_keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", tuple(self.backends))
        if not self.backends:
            raise ValueError("backends: give at least one --backend ADDR")
        for address in self.backends:
            parse_backend(address)
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65536), got {self.metrics_port}")
        for name in ("max_queued_requests", "max_prompt_chars", "max_messages", "max_message_bytes",
                     "affinity_max_blocks", "health_interval_s", "dns_refresh_s", "affinity_max_load_ratio"):
            _positive(name, getattr(self, name))
        for name in ("grace_period_s", "drain_delay_s", "affinity_max_load_gap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "api_keys", tuple(self.api_keys) + tuple(load_api_keys(self.api_keys_file)))


def parse_backend(address: str) -> tuple[str, str, int]:
    """Splits a backend address into (kind, host or path, port).

    Returns:
        ``("unix", path, 0)``, ``("dns", name, port)`` or ``("static", host, port)``.
    Raises:
        ValueError: the address has none of the accepted shapes.
    """
    if address.startswith("unix:"):
        if len(address) == len("unix:"):
            raise ValueError(f"backend {address!r}: unix: needs a path")
        return "unix", address[len("unix:"):], 0
    kind, rest = ("dns", address[len("dns:"):]) if address.startswith("dns:") else ("static", address)
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"backend {address!r}: expected host:port, unix:PATH or dns:NAME:PORT")
    return kind, host, int(port)


def load_api_keys(path: str | None) -> list[str]:
    """Keys from ``path`` (one per line) and from the ``PAGEDSERVE_API_KEYS`` environment variable.

    Read when the config is built (at start), never at import time.
    """
    keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"api_keys_file {path!r}: {exc.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise ValueError(f"api_keys_file {path!r} holds no key")
    return keys
