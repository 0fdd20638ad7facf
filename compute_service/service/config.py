"""Typed, validated configuration of the compute service around the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.service_auth import MEMORY_TOKEN_ENV, check_token, load_token

from pagedserve.config import ServiceConfig, check_listen

DEFAULT_LISTEN = "127.0.0.1:50052"


@dataclass(frozen=True)
class ComputeServiceConfig(ServiceConfig):
    """The gRPC service around the engine (``python -m compute_service``); the engine's own budgets
    stay in EngineConfig, metrics and log level in ServiceConfig.

    Attributes:
        model: "default", a local Hugging Face directory or a GGUF file.
        memory_socket: the memory service's Unix socket (None = its default path).
        listen: "host:port" or "unix:PATH".
        served_model_name: the name Info reports (default: the model's).
        cache_dir: where converted models are cached.
        max_queued_requests: requests in flight (running or waiting) before RESOURCE_EXHAUSTED.
        max_queued_per_tenant: of those, the most one tenant (``GenerateRequest.tenant``) may hold,
            so that one tenant's backlog never fills the queue against a newcomer; default: three
            quarters of ``max_queued_requests`` (192 of 256), the rest kept for the others.
        shutdown_grace_s: on SIGTERM, how long running requests may finish before they are aborted.
        memory_retry_interval_s: pause between attempts to (re)attach to the memory service.
        memory_ping_interval_s: how often an idle engine checks that the memory service is there.
        write_stall_timeout_s: a stream whose client takes no message for this long is aborted (its
            blocks freed); a client that reads, however slowly, is only paused meanwhile.
        max_stream_buffer: step outputs one stream holds for a client that reads slower than the
            engine produces; when full, the request is paused until the client catches up.
        auth_token_file: a file holding the token every call but health must carry
            (``authorization: Bearer TOKEN``); else ``$PAGEDSERVE_COMPUTE_TOKEN``; else no check.
        auth_token: the token itself (read from the file or the environment when not given).
        memory_token_file: a file holding the memory service's token, sent at Attach and on every
            call to it (trusted: it may name cache namespaces); else ``$PAGEDSERVE_MEMORY_TOKEN``.
        memory_token: that token itself (read from the file or the environment when not given).
        grammar_compile_threads: worker processes that compile structured-output constraints.
        grammar_compile_timeout_s: the CPU seconds one constraint may compile before its request is
            refused (INVALID_ARGUMENT: too complex); see ``GrammarCompilerConfig.timeout_s``.
        grammar_cache_size: compiled constraints (and failures) kept.
        grammar_compiles_per_tenant: compiles one tenant may have running at once (the others wait).
        grammar_probe_max_fill_s: CPU seconds one token mask may take when a new grammar's masks are
            probed along sampled outputs (more: INVALID_ARGUMENT, too costly).
    """

    model: str = "default"
    memory_socket: str | None = None
    listen: str = DEFAULT_LISTEN
    served_model_name: str | None = None
    cache_dir: str | None = None
    max_queued_requests: int = 256
    max_queued_per_tenant: int | None = None
    shutdown_grace_s: float = 30.0
    memory_retry_interval_s: float = 0.5
    memory_ping_interval_s: float = 1.0
    write_stall_timeout_s: float = 30.0
    max_stream_buffer: int = 8
    auth_token_file: str | None = None
    auth_token: str | None = field(default=None, repr=False, metadata={"secret": True})
    memory_token_file: str | None = None
    memory_token: str | None = field(default=None, repr=False, metadata={"secret": True})
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 5.0
    grammar_cache_size: int = 256
    grammar_compiles_per_tenant: int = 1
    grammar_probe_max_fill_s: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model:
            raise ValueError("model must be 'default' or a model directory, got an empty string")
        check_listen("listen", self.listen)
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_queued_per_tenant is None:
            object.__setattr__(self, "max_queued_per_tenant",
                               max(1, self.max_queued_requests - self.max_queued_requests // 4))
        elif not 1 <= self.max_queued_per_tenant <= self.max_queued_requests:
            raise ValueError(f"max_queued_per_tenant must be in [1, max_queued_requests={self.max_queued_requests}], "
                             f"got {self.max_queued_per_tenant}")
        for name in ("shutdown_grace_s", "memory_retry_interval_s", "memory_ping_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("grammar_compile_threads", "grammar_cache_size", "grammar_compiles_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("grammar_compile_timeout_s", "grammar_probe_max_fill_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.write_stall_timeout_s > 0:
            raise ValueError(f"write_stall_timeout_s must be > 0, got {self.write_stall_timeout_s}")
        if self.max_stream_buffer < 2:
            raise ValueError(f"max_stream_buffer must be >= 2, got {self.max_stream_buffer}")
        if self.auth_token is not None:
            check_token(self.auth_token, "auth_token")
        else:
            object.__setattr__(self, "auth_token", load_token(self.auth_token_file, "auth_token_file"))
        if self.memory_token is not None:
            check_token(self.memory_token, "memory_token")
        else:
            object.__setattr__(self, "memory_token",
                               load_token(self.memory_token_file, "memory_token_file", env=MEMORY_TOKEN_ENV))
