"""Client-side load for the reliability scenarios: many concurrent streaming clients (one asyncio
task each, over one grpc.aio channel, as a real client library would), an overload burst, a client
that opens many streams and is SIGKILLed, and request churn for the resource-growth check.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc

FINISH_REASONS = ("length", "eos", "stop")


@dataclass
class StreamResult:
    """What one streaming client saw."""

    request_id: str
    code: str = "OK"
    ttft_s: float | None = None
    num_tokens: int = 0
    num_final: int = 0  # pieces with a finish_reason: exactly one in a well-formed stream
    finish_reason: str = ""
    usage_tokens: int = -1
    foreign_ids: int = 0  # pieces carrying another request's id
    elapsed_s: float = 0.0

    def is_well_formed(self, max_tokens: int) -> bool:
        return (self.code == "OK" and self.num_final == 1 and self.finish_reason == "length" and self.foreign_ids == 0
                and self.num_tokens == self.usage_tokens == max_tokens)


@dataclass
class LoadReport:
    results: list[StreamResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def codes(self) -> dict[str, int]:
        tally: dict[str, int] = {}
        for r in self.results:
            tally[r.code] = tally.get(r.code, 0) + 1
        return tally

    def num_well_formed(self, max_tokens: int) -> int:
        return sum(r.is_well_formed(max_tokens) for r in self.results)

    def ttft_percentiles_ms(self) -> dict[str, float]:
        ttfts = sorted(r.ttft_s for r in self.results if r.ttft_s is not None)
        if not ttfts:
            return {"p50": 0.0, "p99": 0.0}
        p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
        return {"p50": round(statistics.median(ttfts) * 1000, 1), "p99": round(p99 * 1000, 1)}


def prompt_for(i: int) -> str:
    """Distinct prompts sharing a prefix (as chat traffic does), a few blocks long."""
    return f"You are a helpful assistant. Answer briefly. Question number {i}: what comes next?"


async def _stream(stub: gateway_pb2_grpc.GatewayStub, request_id: str, prompt: str, max_tokens: int,
                  timeout_s: float, temperature: float, seed: int) -> StreamResult:
    result = StreamResult(request_id)
    request = gateway_pb2.GenerateRequest(prompt=prompt, request_id=request_id, params=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True))
    started = time.perf_counter()
    try:
        async for piece in stub.GenerateStream(request, timeout=timeout_s):
            if piece.request_id != request_id:
                result.foreign_ids += 1
            if piece.token_ids and result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started
            result.num_tokens += len(piece.token_ids)
            if piece.finish_reason:
                result.num_final += 1
                result.finish_reason = piece.finish_reason
                result.usage_tokens = piece.usage.completion_tokens
    except grpc.aio.AioRpcError as exc:
        result.code = exc.code().name
    result.elapsed_s = time.perf_counter() - started
    return result


async def _many(address: str, num_clients: int, max_tokens: int, timeout_s: float, tag: str,
                temperature: float) -> LoadReport:
    report = LoadReport()
    started = time.perf_counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        report.results = list(await asyncio.gather(*(
            _stream(stub, f"{tag}-{i}", prompt_for(i), max_tokens, timeout_s, temperature, i)
            for i in range(num_clients))))
    report.wall_s = time.perf_counter() - started
    return report


def run_streams(address: str, num_clients: int, max_tokens: int, *, timeout_s: float = 120.0,
                tag: str = "load", temperature: float = 0.0) -> LoadReport:
    """``num_clients`` streaming clients at once, each ``max_tokens`` tokens (EOS ignored): greedy, or
    sampled at ``temperature`` with client i's seed i. A sampled stream gets no speculative drafts,
    so it takes one engine step per token; a greedy one on the tiny model, whose output loops, may
    take a draft-accepted handful of tokens a step."""
    return asyncio.run(_many(address, num_clients, max_tokens, timeout_s, tag, temperature))


def metric(metrics_port: int, name: str) -> float:
    """One sample of the Prometheus text at ``metrics_port`` (0.0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# A client process: opens NUM streams, waits for the first piece of the first, says READY, then hangs
# until it is SIGKILLed (a crashed client: no cancel, no goodbye, its connection just drops). It
# reads nothing more, and its channel offers each stream a 1 KiB flow-control window with no BDP
# probing to widen it: a stream's unread replies fill it within a few dozen tokens, and then the
# gateway's write waits, so every stream stays open until the kill (or write_stall_timeout_s) however
# fast the engine is. With gRPC's default windows the unread replies fit, and the streams ran to
# completion in ~2 s, sometimes before the last of them was even admitted.
_VANISHING_CLIENT = """
import sys, threading
import grpc
from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
address, num, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0),
                                                 ("grpc.http2.lookahead_bytes", 1024)])
stub = gateway_pb2_grpc.GatewayStub(channel)
calls = [stub.GenerateStream(gateway_pb2.GenerateRequest(prompt=f"vanishing client stream {i}",
         params=gateway_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=i)))
         for i in range(num)]
started = [next(call) for call in calls[:1]]
print("READY", flush=True)
threading.Event().wait()
"""


def vanishing_client(address: str, num_streams: int, max_tokens: int) -> subprocess.Popen:
    """Starts a client process holding ``num_streams`` open streams, each blocked by its full
    flow-control window; returns once they are sent and the first has produced a token. The caller
    SIGKILLs it."""
    client = subprocess.Popen([sys.executable, "-c", _VANISHING_CLIENT, address, str(num_streams), str(max_tokens)],
                              stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None
    line = client.stdout.readline()
    assert line.strip() == "READY", f"the vanishing client did not start: {line!r}"
    return client


async def _churn(address: str, num_requests: int, concurrency: int) -> dict[str, int]:
    """Mixed traffic: unary, streams, streams cancelled after the first piece, invalid requests."""
    tally: dict[str, int] = {}
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int, stub: gateway_pb2_grpc.GatewayStub) -> None:
        kind = i % 4
        params = gateway_pb2.SamplingParams(max_tokens=2 if kind != 2 else 50, ignore_eos=True, temperature=0.0)
        request = gateway_pb2.GenerateRequest(prompt=f"churn {i % 50}", params=params)
        if kind == 3:
            request.params.top_p = 7.0  # invalid: answered INVALID_ARGUMENT before any backend work
        code = "OK"
        async with semaphore:
            try:
                if kind in (0, 3):
                    await stub.Generate(request, timeout=60)
                else:
                    call = stub.GenerateStream(request, timeout=60)
                    async for _ in call:
                        if kind == 2:
                            call.cancel()
                            code = "CANCELLED"
                            break
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
        tally[code] = tally.get(code, 0) + 1

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(*(one(i, stub) for i in range(num_requests)))
    return tally


def churn(address: str, num_requests: int, concurrency: int = 8) -> dict[str, int]:
    """Sends ``num_requests`` mixed requests; the tally of their outcomes."""
    return asyncio.run(_churn(address, num_requests, concurrency))
