"""The gateway's configuration: one typed, self-validating dataclass (flags and JSON file fill it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gateway.core.tool_parsers import PARSER_NAMES
from gateway.tenants import Tenant, load_tenants
from pagedserve import sampling_rules
from pagedserve.service_auth import API_KEYS_ENV, check_token, load_token
from pagedserve.config import ServiceConfig, check_listen

# Where API keys come from besides --api-keys-file: comma-separated keys.


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """How one gateway listens, finds its backends, routes and protects itself (metrics and log
    level: ServiceConfig).

    Args:
        backends: compute services: ``host:port``, ``unix:PATH`` or ``dns:NAME:PORT`` (every
            address NAME resolves to, re-resolved every ``dns_refresh_s``).
        listen: the public address, ``host:port``.
        http_port: the OpenAI-compatible HTTP API's port (None = no HTTP front; 0 = any free port).
        http_host: its bind address (None = the host of ``listen``).
        api_keys_file: the tenants and their keys: a JSON object ``{"tenants": {"NAME": {"keys":
            [...], "max_priority": P, "max_concurrent": C}}}``, or one key per line (blank lines and
            ``#`` comments ignored; each key a tenant of its own, ``key-1``, ``key-2``, ...); see
            ``gateway.tenants``.
        api_keys: more keys, each a tenant of its own (a JSON config's list); with the keys of
            ``PAGEDSERVE_API_KEYS`` and a plain key file they are named ``key-1``, ``key-2``, ...
        write_stall_timeout_s: a stream whose client reads nothing for this long (its messages
            back up to the flow-control window) is ended DEADLINE_EXCEEDED and its backend request
            aborted.
        tokenize_threads: threads of the tokenizer's own executor (tokenizing a long prompt takes
            milliseconds: off the event loop, and bounded so it cannot take every core).
        tls_cert_file, tls_key_file: PEM certificate chain and private key: serve TLS (both or neither).
        http_read_timeout_s: an HTTP request's headers, then its body, must each arrive within this
            (late headers: the connection is closed; a late body: 408), so idle clients cannot hold
            connections.
        http_max_connections: HTTP connections open at once (at most half the descriptor limit);
            one more takes the place of the one waiting longest for its headers, or, when every open
            connection has its request, is answered 503 and closed at once.
        http_allowed_hosts: ``Host`` names the HTTP front answers (without the port; ``*``: any).
            Loopback names and IP addresses always; empty: those only without API keys (a browser
            page cannot then read a keyless server through DNS rebinding), any with keys.
        max_queued_requests: requests this gateway holds at once (waiting for or streaming from a
            backend); one more is answered RESOURCE_EXHAUSTED at once.
        health_interval_s: how often each backend's health and load are polled.
        dns_refresh_s: how often ``dns:`` backends are resolved again.
        grace_period_s: after SIGTERM, how long in-flight streams may take to finish.
        drain_delay_s: after SIGTERM, how long the gateway still takes new requests while it
            reports NOT_SERVING (the time load balancers need to notice and stop sending).
        max_prompt_chars: longest prompt (or sum of message contents) accepted.
        max_messages: most chat messages accepted.
        max_prompts_per_request: most prompts one HTTP completions request may list (a batch runs
            as that many requests; evaluation harnesses send tens at once). Counted, with the
            tenant's free slots, before any prompt is converted.
        max_message_bytes: largest gRPC request accepted (grpc answers RESOURCE_EXHAUSTED beyond).
        affinity_max_blocks: leading prompt blocks hashed for prefix affinity.
        affinity_max_load_gap: affinity yields when its backend's outstanding tokens exceed the
            least loaded backend's by more than this ...
        affinity_max_load_ratio: ... and by more than this factor (both must hold, as in SGLang's
            router: a small absolute gap or a small ratio is noise, not imbalance).
        affinity_tier_weight: what a prompt block predicted only in a backend's KV tier (below its
            memory service's pool: a load, not a pool hit) is worth for affinity, a pool block being
            worth 1; in [0, 1] (docs/design.md, "Prefix affinity across shared pools and tiers").
        log_prompts: put prompt text into access log lines (off: prompts are user data).
        backend_token_file: a file holding the token the compute services require (sent as
            ``authorization: Bearer TOKEN`` on every call to them); else ``$PAGEDSERVE_COMPUTE_TOKEN``.
        backend_token: the token itself (read from the file or the environment when not given).
        tool_call_parser: how ``tool_choice: auto`` reads a model's calls: "hermes", "llama3_json",
            or "auto" (from the chat template; ``gateway.core.tool_parsers``).
        chat_template_file: a Jinja chat template to use instead of the backends' (vLLM's
            ``--chat-template``), read at start.
        embedding_pooling: how ``/v1/embeddings`` pools the model's final hidden states: "last"
            (the last prompt token's, vLLM's default for decoder models) or "mean".
        responses_store_max_responses, responses_store_max_bytes, responses_store_ttl_s: per
            tenant, the Responses API's stored responses (``store: true``): how many, how many
            bytes of JSON, kept how long (``gateway.openai_api.response_store``).
        responses_store_max_total_bytes: the bytes of all tenants' stored responses together (past
            it, the tenant holding the most loses its oldest).
    """

    backends: tuple[str, ...] = ()
    listen: str = "127.0.0.1:50051"
    http_port: int | None = None
    http_host: str | None = None
    api_keys_file: str | None = None
    max_queued_requests: int = 1024
    health_interval_s: float = 1.0
    dns_refresh_s: float = 10.0
    grace_period_s: float = 30.0
    drain_delay_s: float = 0.0
    max_prompt_chars: int = sampling_rules.MAX_PROMPT_CHARS
    max_messages: int = sampling_rules.MAX_MESSAGES
    max_prompts_per_request: int = 256
    max_message_bytes: int = 4 << 20
    affinity_max_blocks: int = 32
    affinity_max_load_gap: int = 4096
    affinity_max_load_ratio: float = 2.0
    affinity_tier_weight: float = 0.5
    log_prompts: bool = False
    write_stall_timeout_s: float = 30.0
    tokenize_threads: int = 2
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    http_read_timeout_s: float = 10.0
    http_max_connections: int = 1024
    http_allowed_hosts: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    backend_token_file: str | None = None
    backend_token: str | None = field(default=None, repr=False)
    tool_call_parser: str = "auto"
    chat_template_file: str | None = None
    embedding_pooling: str = "last"
    responses_store_max_responses: int = 1000
    responses_store_max_bytes: int = 64 << 20
    responses_store_ttl_s: float = 3600.0
    responses_store_max_total_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "backends", tuple(self.backends))
        if not self.backends:
            raise ValueError("backends: give at least one --backend ADDR")
        for address in self.backends:
            parse_backend(address)
        check_listen("listen", self.listen, allow_unix=False)
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65536), got {self.http_port}")
        for name in ("max_queued_requests", "max_prompt_chars", "max_messages", "max_prompts_per_request",
                     "max_message_bytes",
                     "affinity_max_blocks", "health_interval_s", "dns_refresh_s", "affinity_max_load_ratio",
                     "write_stall_timeout_s", "tokenize_threads", "http_read_timeout_s", "http_max_connections",
                     "responses_store_max_responses", "responses_store_max_bytes", "responses_store_ttl_s",
                     "responses_store_max_total_bytes"):
            _positive(name, getattr(self, name))
        for name in ("grace_period_s", "drain_delay_s", "affinity_max_load_gap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.affinity_tier_weight <= 1.0:
            raise ValueError(f"affinity_tier_weight must be in [0, 1], got {self.affinity_tier_weight}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file, tls_key_file: give both (or neither)")
        if self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.embedding_pooling not in sampling_rules.POOLING_TYPES:
            raise ValueError(f"embedding_pooling must be one of {', '.join(sampling_rules.POOLING_TYPES)}, "
                             f"got {self.embedding_pooling!r}")
        for name in ("tls_cert_file", "tls_key_file", "chat_template_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path!r} is not a readable file")
        if not isinstance(self.http_allowed_hosts, list | tuple) or not all(
                isinstance(h, str) and h.strip() for h in self.http_allowed_hosts):
            raise ValueError(f"http_allowed_hosts must be a list of host names, got {self.http_allowed_hosts!r}")
        object.__setattr__(self, "http_allowed_hosts", tuple(h.strip().lower() for h in self.http_allowed_hosts))
        # A string where a list belongs would otherwise become one key per character.
        if not isinstance(self.api_keys, list | tuple) or not all(isinstance(k, str) for k in self.api_keys):
            raise ValueError(f"api_keys must be a list of strings, got {type(self.api_keys).__name__}")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "_tenants", load_configured_tenants(self))
        if self.backend_token is not None:
            check_token(self.backend_token, "backend_token")
        else:
            object.__setattr__(self, "backend_token", load_token(self.backend_token_file, "backend_token_file"))

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """The configured tenants (empty: no keys, local use); read when the config is built."""
        return self._tenants  # type: ignore[attr-defined]

    @property
    def http_bind_host(self) -> str:
        """Where the HTTP front binds: ``http_host``, else the gRPC front's host (``[::]`` unbracketed)."""
        if self.http_host is not None:
            return self.http_host
        return self.listen.rpartition(":")[0].strip("[]")


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


def load_configured_tenants(config: GatewayConfig) -> tuple[Tenant, ...]:
    """Tenants from ``api_keys``, ``PAGEDSERVE_API_KEYS`` and ``api_keys_file``, in that order.

    Read when the config is built (at start), never at import time.
    """
    keys = [*config.api_keys, *(k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip())]
    text = None
    if config.api_keys_file is not None:
        try:
            text = Path(config.api_keys_file).read_text()
        except OSError as exc:
            raise ValueError(f"api_keys_file {config.api_keys_file!r}: {exc.strerror}") from None
    return load_tenants(keys, text, f"api_keys_file {config.api_keys_file!r}", config.max_queued_requests)
