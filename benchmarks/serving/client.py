"""Streaming clients of the public gateway API (grpc.aio; the OpenAI-compatible HTTP API's is
``openai_client``) and a sampler of the memory service's KV usage, for the serving benchmark.

Every request is one ``GenerateStream`` call, its own asyncio task, all on one channel (the gateway
multiplexes them as it would many clients). Times are taken in this process when a message
arrives: what a client sees, gateway and network included.

- TTFT: from sending the request to the first message that carries tokens.
- TPOT (time per output token): (last token's arrival - first token's arrival) / (tokens - 1), the
  decode pace after the first token; undefined (None) for one-token outputs.
- End-to-end latency: from sending to the last message (usage included).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from benchmarks.serving.workload import RequestSpec
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc


@dataclass
class RequestResult:
    """What one request saw; times in seconds (``sent_at`` and ``finished_at`` on perf_counter)."""

    max_tokens: int
    status: str = "OK"  # a grpc.StatusCode name otherwise
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0  # counted from the streamed token ids
    usage_tokens: int = 0  # the reply's usage.completion_tokens
    sent_at: float = 0.0
    finished_at: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def e2e_s(self) -> float:
        return self.finished_at - self.sent_at


def generate_request(spec: RequestSpec, cache_salt: str) -> gateway_pb2.GenerateRequest:
    """``ignore_eos``: every request generates exactly ``max_tokens`` tokens, greedy or sampled as
    ``spec`` says (never seeded)."""
    params = gateway_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                                        ignore_eos=True)
    return gateway_pb2.GenerateRequest(prompt=spec.prompt, params=params, cache_salt=cache_salt)


async def stream_one(stub: gateway_pb2_grpc.GatewayStub, spec: RequestSpec, cache_salt: str,
                     timeout_s: float) -> RequestResult:
    """Send one streaming request and time its messages; an RPC error is recorded, not raised."""
    result = RequestResult(spec.max_tokens)
    first = last = None
    result.sent_at = time.perf_counter()
    try:
        async for message in stub.GenerateStream(generate_request(spec, cache_salt), timeout=timeout_s):
            now = time.perf_counter()
            if message.token_ids:
                first = now if first is None else first
                last = now
                result.output_tokens += len(message.token_ids)
            if message.HasField("usage"):
                result.prompt_tokens = message.usage.prompt_tokens
                result.cached_tokens = message.usage.cached_prompt_tokens
                result.usage_tokens = message.usage.completion_tokens
    except grpc.aio.AioRpcError as exc:
        result.status = exc.code().name
    result.finished_at = time.perf_counter()
    if first is not None:
        result.ttft_s = first - result.sent_at
        if result.output_tokens > 1:
            result.tpot_s = (last - first) / (result.output_tokens - 1)
    return result


Send = Callable[[RequestSpec, str, float], Awaitable[RequestResult]]


@dataclass(frozen=True)
class Target:
    """What the benchmark sends to: the gateway's gRPC API at ``host:port``, or an OpenAI-compatible
    HTTP API at ``http://host:port`` (ours or another server's; ``model`` is the name it serves)."""

    address: str
    api: str = "grpc"
    model: str = ""


@contextlib.asynccontextmanager
async def session(target: Target) -> AsyncIterator[Send]:
    """A sender of streamed requests over one channel (gRPC) or one connection pool (HTTP)."""
    if target.api == "openai":
        from benchmarks.serving.openai_client import OpenAISession

        http = OpenAISession(target.address, target.model)
        try:
            yield http.stream_one
        finally:
            await http.close()
        return
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        yield lambda spec, salt, timeout_s: stream_one(stub, spec, salt, timeout_s)


async def run_arrivals(target: Target, specs: list[RequestSpec], arrivals: list[float], cache_salt: str,
                       timeout_s: float) -> list[RequestResult]:
    """Send ``specs[i]`` at ``arrivals[i]`` seconds from now, each as its own task, and wait for all."""
    async with session(target) as send:
        return await send_at(arrivals, [lambda spec=spec: send(spec, cache_salt, timeout_s) for spec in specs])


async def send_at(arrivals: list[float], starts: list[Callable[[], Awaitable[RequestResult]]]) -> list[RequestResult]:
    """Start ``starts[i]()`` at ``arrivals[i]`` seconds from now, each as its own task; wait for all
    (the Poisson schedule of every client: ours and vLLM's)."""
    start = time.perf_counter()
    tasks = []
    for begin, at in zip(starts, arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(begin()))
    return list(await asyncio.gather(*tasks))


async def run_one_at_a_time(target: Target, specs: list[RequestSpec], cache_salts: list[str],
                            timeout_s: float) -> list[RequestResult]:
    """The unloaded baseline (and the shared-prefix runs): each request sent after the previous one
    finished, so nothing else runs in the engine meanwhile."""
    async with session(target) as send:
        return [await send(spec, salt, timeout_s) for spec, salt in zip(specs, cache_salts)]


async def describe_target(target: Target, text: str) -> tuple[Target, str, int | None, float]:
    """The target with its model's name filled in, that name, its block size (gRPC only) and its
    tokenizer's tokens per word on ``text`` (prompts are sized by it)."""
    if target.api == "openai":
        from benchmarks.serving.openai_client import describe_server

        name, tpw = await describe_server(target.address, text)
        return Target(target.address, target.api, name), name, None, tpw
    model, tpw = await describe_gateway(target.address, text)
    return target, model.name, model.block_size, tpw


async def describe_gateway(address: str, text: str) -> tuple[gateway_pb2.ModelInfo, float]:
    """The model the gateway serves, and its tokenizer's tokens per word on ``text`` (prompts are
    sized by it)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        models = (await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=30)).models
        reply = await stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=text), timeout=30)
    if not models:
        raise RuntimeError(f"the gateway at {address} serves no model yet (no backend reached)")
    return models[0], len(reply.token_ids) / len(text.split())


@dataclass
class KvSample:
    """The memory service's pool at one moment (``t_s`` from the sampler's start)."""

    t_s: float
    used_blocks: int  # held by running sequences
    cached_blocks: int  # unreferenced, keeping a cached prefix (evictable)
    total_blocks: int
    num_sequences: int
    num_evictions: int  # cached blocks reclaimed for new data since the memory service started


@dataclass
class KvSampler:
    """Polls the memory service's Stats RPC every ``interval_s`` while the rate sweep runs.

    Stats is a read of counters in the memory service: polling it twice a second costs the engine
    nothing measurable. ``marks`` records when each phase of the sweep started and ended.
    """

    address: str
    interval_s: float = 0.5
    samples: list[KvSample] = field(default_factory=list)
    marks: list[tuple[str, float, float]] = field(default_factory=list)  # (label, start s, end s)
    _start: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        return time.perf_counter() - self._start

    async def run(self, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = memory_pb2_grpc.MemoryManagerStub(channel)
            while not stop.is_set():
                stats = await stub.Stats(memory_pb2.StatsRequest(), timeout=10)
                self.samples.append(KvSample(
                    round(self.now(), 3), sum(p.num_used_blocks for p in stats.pools),
                    sum(p.num_cached_blocks for p in stats.pools), sum(p.num_total_blocks for p in stats.pools),
                    stats.num_sequences, stats.num_evictions))
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                except TimeoutError:
                    pass
