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

BAD_CODES = ("INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED")
INTS = (0, 1, 2, 3, -1, 16, 64, 65, 257, 2**31 - 1, -(2**31), 100_000)
FLOATS = (0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 1e-45, 1e-30, 3.4e38, -3.4e38, float("nan"), float("inf"), float("-inf"))
TEXTS = ("", "a", "hi", "\x00", "\x00\x01\x7f", "héllo wörld €", "\U0001f600" * 3, "\U0010ffff", " " * 64,
         "<s></s>", "{{ messages }}{% raw %}", "\n" * 10)
ROLES = ("system", "user", "assistant", "tool", "", "wizard", "USER", "\x00")


class Case(NamedTuple):
    """One request: the method's full name, its wire bytes, and whether it answers a stream."""

    method: str
    request: bytes
    streaming: bool


class FuzzRandom(random.Random):
    """A seeded source whose ``clean`` cases draw only in-range values, so that the paths behind
    validation (generation, allocation, sharing, forks) get their share of hostile traffic too."""

    clean = False


def _text(rng: random.Random, *, oversize: int = 0) -> str:
    if getattr(rng, "clean", False):
        return rng.choice(("hi", "héllo wörld €", "a b c", "\U0001f600 ok"))
    pick = rng.random()
    if oversize and pick < 0.02:
        return "x" * oversize
    if pick < 0.15:
        return _valid_text(rng)
    return rng.choice(TEXTS) * rng.choice((1, 1, 1, 5, 300))


def _valid_text(rng: random.Random) -> str:
    """A random string without surrogates (protobuf refuses those before anything is sent)."""
    return "".join(chr(c) for c in (rng.randint(1, 0x10FFFF) for _ in range(rng.randint(1, 32)))
                   if not 0xD800 <= c < 0xE000)


def _int(rng: random.Random) -> int:
    if getattr(rng, "clean", False):
        return rng.choice((1, 2, 3))
    return rng.choice(INTS) if rng.random() < 0.8 else rng.randint(-1000, 1000)


def _float(rng: random.Random) -> float:
    if getattr(rng, "clean", False):
        return rng.uniform(0.1, 1.0)
    return rng.choice(FLOATS) if rng.random() < 0.8 else rng.uniform(-3.0, 3.0)


def _maybe(rng: random.Random, probability: float = 0.5) -> bool:
    return rng.random() < probability


def _sampling_fields(rng: random.Random) -> dict[str, object]:
    """Random values for the fields both SamplingParams messages share."""
    fields: dict[str, object] = {}
    for name in ("top_k", "min_tokens", "n"):
        if _maybe(rng, 0.3):
            fields[name] = _int(rng)
    for name in ("min_p", "presence_penalty", "frequency_penalty", "temperature", "repetition_penalty", "top_p"):
        if _maybe(rng, 0.3):
            fields[name] = _float(rng)
    # Small max_tokens keeps the valid cases cheap; the boundary values are rejected up front.
    fields["max_tokens"] = rng.choice((1, 2, 3, 4, 0, -1, 2**31 - 1, 100_000)) if _maybe(rng, 0.9) else _int(rng)
    if getattr(rng, "clean", False):
        fields["max_tokens"] = rng.randint(1, 4)
    if _maybe(rng, 0.2):
        fields["seed"] = rng.choice((0, 1, 2**64 - 1, rng.getrandbits(64)))
    if _maybe(rng, 0.2):
        fields["logprobs"] = _int(rng)
    if _maybe(rng, 0.2):
        fields["ignore_eos"] = True
    if _maybe(rng, 0.2):
        fields["stop"] = [_text(rng) for _ in range(rng.choice((1, 2, 16, 17, 5000)))]
    if _maybe(rng, 0.15):
        fields["stop_token_ids"] = [_int(rng) for _ in range(rng.choice((1, 3, 2000)))]
    if getattr(rng, "clean", False):
        fields["stop"] = fields.get("stop", [])[:2]
        fields["stop_token_ids"] = fields.get("stop_token_ids", [])[:2]
    if fields.get("n", 1) not in (0, 1) and "temperature" not in fields:
        fields["temperature"] = 1.0  # n > 1 is refused when greedy: exercise the real path too
    return fields


def gateway_request(rng: random.Random) -> gpb.GenerateRequest:
    request = gpb.GenerateRequest(params=gpb.SamplingParams(**_sampling_fields(rng)))
    if _maybe(rng, 0.6):
        request.prompt = _text(rng, oversize=(1 << 20) + 1)
    if _maybe(rng, 0.5):
        num = rng.choice((1, 2, 3, 1025)) if _maybe(rng, 0.9) else 5000
        request.messages.extend(gpb.ChatMessage(role=rng.choice(ROLES), content=_text(rng)) for _ in range(num))
    if getattr(rng, "clean", False):  # exactly one of prompt or a few messages, known roles
        if request.prompt or not request.messages:
            del request.messages[:]
            request.prompt = request.prompt or "hi"
        else:
            for message in request.messages[:3]:
                message.role = rng.choice(ROLES[:4])
            del request.messages[3:]
    for name in ("request_id", "cache_salt"):
        if _maybe(rng, 0.2):
            setattr(request, name, _text(rng))
    if _maybe(rng, 0.2):
        request.priority = _int(rng)
    return request


def compute_request(rng: random.Random, vocab_size: int) -> cpb.GenerateRequest:
    clean = getattr(rng, "clean", False)
    ids = [rng.randrange(vocab_size) for _ in range(rng.choice((1, 5, 40) if clean else (0, 1, 5, 40)))]
    if not clean and _maybe(rng, 0.2):
        ids += [rng.choice((-1, vocab_size, 2**31 - 1, -(2**31)))]
    if not clean and _maybe(rng, 0.03):
        ids = [1] * rng.choice((1024, 100_000))
    request = cpb.GenerateRequest(prompt_token_ids=ids, params=cpb.SamplingParams(**_sampling_fields(rng)))
    for name in ("request_id", "cache_salt"):
        if _maybe(rng, 0.2):
            setattr(request, name, _text(rng))
    if _maybe(rng, 0.2):
        request.priority = _int(rng)
    return request


def memory_request(rng: random.Random, client_id: str) -> tuple[str, Message]:
    """A MemoryManager call by (or pretending to be) the fuzzing client: mostly Steps."""
    pick = rng.random()
    if pick < 0.05:
        return "Attach", mpb.AttachRequest(client_name=_text(rng), layout=mpb.KvLayout(
            num_layers=_int(rng), num_kv_heads=_int(rng), head_dim=_int(rng), dtype=rng.choice(("float32", "", "x")),
            block_size=_int(rng)))
    if pick < 0.1:
        return "GetBlockTable", mpb.GetBlockTableRequest(client_id=client_id, seq_id=_seq_id(rng))
    if pick < 0.13:
        return "Stats", mpb.StatsRequest()
    if getattr(rng, "clean", False):
        return "Step", mpb.StepRequest(client_id=client_id, ops=[_clean_memory_op(rng)])
    who = client_id if _maybe(rng, 0.9) else _text(rng)
    step = mpb.StepRequest(client_id=who)
    for section in (step.ops, step.late_ops):
        for _ in range(rng.choice((0, 1, 2, 5))):
            section.append(_memory_op(rng))
    if _maybe(rng, 0.3):
        seq_ids = [_seq_id(rng) for _ in range(rng.choice((1, 2, 3)))]
        counts = [rng.choice((1, 2) if getattr(rng, "clean", False) else (0, 1, 2, 17, -1)) for _ in seq_ids]
        if not getattr(rng, "clean", False) and _maybe(rng, 0.2):
            counts.append(1)  # lengths that disagree
        step.appends.CopyFrom(mpb.AppendBatch(seq_ids=seq_ids, num_tokens=counts,
                                              token_ids=[_int(rng) for _ in range(max(0, sum(counts)))]))
    return "Step", step


def _seq_id(rng: random.Random) -> str:
    if getattr(rng, "clean", False):
        return rng.choice(("s0", "s1", "s2", "s3"))
    return rng.choice(("s0", "s1", "s2", "s3", "", "s0/1", _text(rng)))


def _clean_memory_op(rng: random.Random) -> mpb.SequenceOp:
    """A plausible op of a well-behaved client: the generator tracks the sequences it believes are
    live (a guess: an op that ran out of blocks did not create its sequence), so allocations, growth,
    forks and frees, prefix sharing and eviction all run."""
    live: list[str] = rng.__dict__.setdefault("live_seq_ids", [])
    pick = rng.random()
    if not live or pick < 0.35:
        live.append(f"c{rng.getrandbits(32)}")
        prefix = [7] * 16 * rng.randint(0, 3)  # shared full blocks: the prefix cache hits
        return mpb.SequenceOp(allocate=mpb.AllocateOp(
            seq_id=live[-1], prompt_token_ids=prefix + [rng.randrange(50) for _ in range(rng.randint(1, 40))],
            max_num_new_tokens=rng.choice((1, 16, 64)), namespace=rng.choice(("", "tenant-a"))))
    seq_id = rng.choice(live)
    if pick < 0.6:
        return mpb.SequenceOp(append=mpb.AppendOp(seq_id=seq_id, token_ids=[rng.randrange(50) for _ in range(rng.randint(1, 3))]))
    if pick < 0.85:
        live.remove(seq_id)
        return mpb.SequenceOp(free=mpb.FreeOp(seq_id=seq_id))
    live.append(f"c{rng.getrandbits(32)}")
    return mpb.SequenceOp(fork=mpb.ForkOp(parent_seq_id=seq_id, child_seq_id=live[-1]))


def _memory_op(rng: random.Random) -> mpb.SequenceOp:
    kind = rng.choice(("allocate", "allocate", "append", "free", "free", "fork"))
    if kind == "allocate":
        tokens = [rng.randrange(50) for _ in range(rng.choice((0, 1, 5, 40, 300)))]
        if _maybe(rng, 0.1):
            tokens.append(_int(rng))
        return mpb.SequenceOp(allocate=mpb.AllocateOp(
            seq_id=_seq_id(rng), prompt_token_ids=tokens or [1],
            max_num_new_tokens=rng.choice((1, 4, 16) if getattr(rng, "clean", False) else (1, 4, 16, 0, -1, 2**31 - 1)),
            priority=_int(rng) if _maybe(rng, 0.2) else 0, namespace=_text(rng) if _maybe(rng, 0.2) else ""))
    if kind == "append":
        return mpb.SequenceOp(append=mpb.AppendOp(seq_id=_seq_id(rng), token_ids=[_int(rng) for _ in range(rng.choice((0, 1, 3, 33)))]))
    if kind == "free":
        return mpb.SequenceOp(free=mpb.FreeOp(seq_id=_seq_id(rng)))
    return mpb.SequenceOp(fork=mpb.ForkOp(parent_seq_id=_seq_id(rng), child_seq_id=_seq_id(rng)))


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
        rng.clean = _maybe(rng, 0.3)
        method, message, streaming = make(rng)
        data = message.SerializeToString()
        if not rng.clean and _maybe(rng, 0.25):
            data = damage(rng, data, string_fields)
        yield Case(method, data, streaming)


def gateway_cases(num_cases: int, seed: int = 0) -> Iterator[Case]:
    def make(rng: random.Random) -> tuple[str, Message, bool]:
        streaming = _maybe(rng)
        method = "GenerateStream" if streaming else rng.choice(("Generate", "Generate", "Tokenize"))
        request = gateway_request(rng)
        if method == "Tokenize":
            request = gpb.TokenizeRequest(prompt=request.prompt, messages=request.messages)
        return f"/pagedserve.gateway.v1.Gateway/{method}", request, streaming
    return cases(make, (1, 5, 6), num_cases, seed)


def compute_cases(num_cases: int, vocab_size: int, seed: int = 0) -> Iterator[Case]:
    def make(rng: random.Random) -> tuple[str, Message, bool]:
        if _maybe(rng, 0.1):
            return "/pagedserve.compute.v1.Compute/Abort", cpb.AbortRequest(request_id=_text(rng)), False
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
            return run_cases(target, memory_cases(num_cases, client_id, seed), **kwargs)  # type: ignore[arg-type]
        finally:
            stub.Detach(mpb.DetachRequest(client_id=client_id), timeout=10)


def run_cases(target: str, all_cases: Iterator[Case], *, timeout_s: float = 30.0, concurrency: int = 1) -> Counter[str]:
    """Sends every case to ``target`` (``concurrency`` at a time); the tally of status codes."""
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        with ThreadPoolExecutor(concurrency) as pool:
            return Counter(pool.map(lambda case: send(channel, case, timeout_s), all_cases))
