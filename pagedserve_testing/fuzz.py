"""A seeded generator of hostile requests for the three services, and a runner that tallies the
status codes they get.

Why our own generator rather than hypothesis: the target is a live stack, and what we want is a
fixed number of cases per service with a tally of status codes (the benchmark reports it), not
shrinking. Each case starts as a message of random boundary values (NaN, inf, denormals, huge and
negative numbers, empty and oversize strings, NUL and astral characters, unknown roles, thousands of
stop strings or messages); three cases in ten draw only in-range values instead, and one in
four of the others is then damaged on the wire: truncated, a byte
flipped, a string field holding invalid UTF-8 (protobuf refuses to build that, so it is spliced in as
raw bytes), or a field sent with the wrong wire type.

The contract under test: every answer is a deliberate status (OK, INVALID_ARGUMENT, ...), never
INTERNAL, UNKNOWN or a hang (DEADLINE_EXCEEDED), and the service keeps serving.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc
from google.protobuf.message import Message

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.gateway.v1 import gateway_pb2 as gpb
from pagedserve.memory.v1 import memory_pb2 as mpb
from pagedserve.memory.v1 import memory_pb2_grpc as mpb_grpc
from pagedserve_testing.fuzz_requests import (
    FuzzRandom, compute_request, gateway_request, maybe, memory_request, text,
)

BAD_CODES = ("INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED")


class Case(NamedTuple):
    """One request: the method's full name, its wire bytes, and whether it answers a stream."""

    method: str
    request: bytes
    streaming: bool


# --- damage on the wire -------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def damage(rng: random.Random, data: bytes, string_fields: tuple[int, ...]) -> bytes:
    """``data`` truncated, a byte flipped, invalid UTF-8 in a string field, or a wrong wire type."""
    pick = rng.randrange(4)
    if pick == 0 and data:
        return data[:rng.randrange(len(data))]
    if pick == 1 and data:
        i = rng.randrange(len(data))
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    number = rng.choice(string_fields)
    if pick == 2 or not data:
        bad = rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xf4\x90\x80\x80", b"\xe2\x82"))
        return data + _field(number, 2, _varint(len(bad)) + bad)
    return data + _field(number, 0, _varint(rng.getrandbits(40)))


# --- running --------------------------------------------------------------------------------------


def cases(make: Callable[[random.Random], tuple[str, Message, bool]], string_fields: tuple[int, ...],
          num_cases: int, seed: int) -> Iterator[Case]:
    """``num_cases`` cases from ``make`` (method, message, streaming), 30% clean, the rest hostile."""
    rng = FuzzRandom(seed)
    for _ in range(num_cases):
        rng.clean = maybe(rng, 0.3)
        method, message, streaming = make(rng)
        data = message.SerializeToString()
        if not rng.clean and maybe(rng, 0.25):
            data = damage(rng, data, string_fields)
        yield Case(method, data, streaming)


def gateway_cases(num_cases: int, seed: int = 0) -> Iterator[Case]:
    def make(rng: random.Random) -> tuple[str, Message, bool]:
        streaming = maybe(rng)
        method = "GenerateStream" if streaming else rng.choice(("Generate", "Generate", "Tokenize"))
        request = gateway_request(rng)
        if method == "Tokenize":
            request = gpb.TokenizeRequest(prompt=request.prompt, messages=request.messages)
        return f"/pagedserve.gateway.v1.Gateway/{method}", request, streaming
    return cases(make, (1, 5, 6), num_cases, seed)


def compute_cases(num_cases: int, vocab_size: int, seed: int = 0) -> Iterator[Case]:
    def make(rng: random.Random) -> tuple[str, Message, bool]:
        if maybe(rng, 0.1):
            return "/pagedserve.compute.v1.Compute/Abort", cpb.AbortRequest(request_id=text(rng)), False
        return "/pagedserve.compute.v1.Compute/Generate", compute_request(rng, vocab_size), True
    return cases(make, (1, 5), num_cases, seed)


def memory_cases(num_cases: int, client_id: str, seed: int = 0) -> Iterator[Case]:
    def make(rng: random.Random) -> tuple[str, Message, bool]:
        method, message = memory_request(rng, client_id)
        return f"/pagedserve.memory.v1.MemoryManager/{method}", message, False
    return cases(make, (1, 2), num_cases, seed)


def send(channel: grpc.Channel, case: Case, timeout_s: float) -> str:
    """Sends one case; returns the status code's name."""
    identity = bytes
    try:
        if case.streaming:
            for _ in channel.unary_stream(case.method, request_serializer=identity, response_deserializer=identity)(
                    case.request, timeout=timeout_s):
                pass
        else:
            channel.unary_unary(case.method, request_serializer=identity, response_deserializer=identity)(
                case.request, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def send_raw(target: str, method: str, data: bytes, timeout_s: float = 10.0) -> str:
    """One unary call of raw bytes on a fresh channel; the status code's name."""
    with grpc.insecure_channel(target) as channel:
        return send(channel, Case(method, data, streaming=False), timeout_s)


def run_memory_fuzz(target: str, layout: mpb.KvLayout, num_cases: int, seed: int, **kwargs: object) -> Counter[str]:
    """Attaches a fuzzing client with ``layout`` (the pool's own), runs ``num_cases`` memory cases as
    that client, then detaches it (its sequences are freed)."""
    with grpc.insecure_channel(target) as channel:
        stub = mpb_grpc.MemoryManagerStub(channel)
        client_id = stub.Attach(mpb.AttachRequest(client_name="fuzz", layout=layout), timeout=10).client_id
        try:
            tally = run_cases(target, memory_cases(num_cases, client_id, seed), **kwargs)  # type: ignore[arg-type]
            integrity = stub.CheckIntegrity(mpb.CheckIntegrityRequest(), timeout=30)
            assert integrity.ok, f"memory service integrity check failed after fuzzing: {integrity.problem}"
            return tally
        finally:
            stub.Detach(mpb.DetachRequest(client_id=client_id), timeout=10)


def run_cases(target: str, all_cases: Iterator[Case], *, timeout_s: float = 30.0, concurrency: int = 1) -> Counter[str]:
    """Sends every case to ``target`` (``concurrency`` at a time); the tally of status codes."""
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        with ThreadPoolExecutor(concurrency) as pool:
            return Counter(pool.map(lambda case: send(channel, case, timeout_s), all_cases))
