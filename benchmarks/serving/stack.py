"""The stacks the serving benchmark starts for itself: memory, compute and gateway as three real
processes each, through ``pagedserve.stack`` (as ``pagedserve up`` and the tests start them).
Several stacks start side by side, so that their model loads overlap.

Prefix caching is switched where the cache lives, in the memory service
(``--enable-prefix-caching``): the compute service asks for prefix matches on every admission and
gets none from a memory service without a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.serving.client import Target
from pagedserve import stack
from pagedserve.sockets import free_port


@dataclass(frozen=True)
class StackConfig:
    """What to start.

    Args:
        model: "default" or a local Hugging Face model directory.
        kv_cache_bytes: the KV pool's size.
        block_size: tokens per KV block (memory and compute must agree).
        enable_prefix_caching: the memory service's prefix cache.
        max_num_seqs: the engine's running sequences at most (None = its default).
        max_num_batched_tokens: the engine's new tokens per step, prompt chunks included (None = its
            default): how long one step's prefill may stall the running sequences' next tokens.
        num_speculative_tokens: the engine's n-gram drafts per greedy sequence (None = its default).
        dtype: the compute service's ``--dtype`` (None = its default, auto).
        quantization: the compute service's ``--quantization`` (None = its default, auto).
        ready_timeout_s: how long each service may take to become SERVING (model loading included).
    """

    model: str = "default"
    kv_cache_bytes: int = 512 << 20
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_speculative_tokens: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_events_endpoint: str | None = None  # the memory service's KV events (a ZMQ PUB address), off by default
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")

    def stack_config(self, http_port: int) -> stack.StackConfig:
        """These sizes as the services' command lines (the gateway's HTTP front on ``http_port``);
        every service logs warnings only."""
        quiet = ("--log-level", "warning")
        memory = ("--kv-cache-bytes", str(self.kv_cache_bytes), "--block-size", str(self.block_size),
                  "--enable-prefix-caching", str(self.enable_prefix_caching).lower(), *quiet)
        if self.kv_events_endpoint is not None:
            memory += ("--kv-events-endpoint", self.kv_events_endpoint)
        compute = ["--block-size", str(self.block_size), *quiet]
        for flag, value in (("--max-num-seqs", self.max_num_seqs),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens),
                            ("--num-speculative-tokens", self.num_speculative_tokens),
                            ("--dtype", self.dtype), ("--quantization", self.quantization)):
            if value is not None:
                compute += [flag, str(value)]
        return stack.StackConfig(model=self.model, memory_args=memory, compute_args=tuple(compute),
                                 gateway_args=("--http-port", str(http_port), "--health-interval-s", "0.5", *quiet),
                                 ready_timeout_s=self.ready_timeout_s)


@dataclass
class ServingStack:
    """One started stack (``pagedserve.stack.Stack``) and the gateway's two fronts."""

    stack: stack.Stack
    http_port: int  # the gateway's OpenAI-compatible HTTP front

    @property
    def services(self) -> list:
        return self.stack.services

    @property
    def directory(self):
        return self.stack.directory

    @property
    def memory_address(self) -> str:
        assert self.stack.memory is not None
        return self.stack.memory.address

    @property
    def gateway_address(self) -> str:
        assert self.stack.gateway is not None
        return self.stack.gateway.address

    def target(self, api: str) -> Target:
        """Where the benchmark sends: the gateway's gRPC front, or its OpenAI-compatible HTTP front."""
        if api == "openai":
            return Target(f"http://127.0.0.1:{self.http_port}", "openai")
        return Target(self.gateway_address, "grpc")

    def stop(self) -> dict[str, int]:
        """Stops gateway, compute, memory (in that order) by PID; returns their exit statuses."""
        return self.stack.stop()


def start_stacks(configs: list[StackConfig]) -> list[ServingStack]:
    """One started stack per config, side by side (``pagedserve.stack.start_stacks``), each in a
    fresh directory that ``stop`` removes."""
    ports = [free_port() for _ in configs]
    started = stack.start_stacks([stack.Stack(c.stack_config(port)) for c, port in zip(configs, ports)])
    return [ServingStack(s, port) for s, port in zip(started, ports)]
