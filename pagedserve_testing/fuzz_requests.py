"""Random requests for the fuzzer (``fuzz.py``): boundary values of every type, and the three
services' request messages built from them. A ``FuzzRandom`` whose ``clean`` flag is set draws only
in-range values, so the paths behind validation get hostile traffic too."""

from __future__ import annotations

import random
from typing import TypeVar

from google.protobuf.message import Message

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.gateway.v1 import gateway_pb2 as gpb
from pagedserve.memory.v1 import memory_pb2 as mpb

Request = TypeVar("Request", gpb.GenerateRequest, cpb.GenerateRequest)

INTS = (0, 1, 2, 3, -1, 16, 64, 65, 257, 2**31 - 1, -(2**31), 100_000)
FLOATS = (0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 1e-45, 1e-30, 3.4e38, -3.4e38, float("nan"), float("inf"), float("-inf"))
TEXTS = ("", "a", "hi", "\x00", "\x00\x01\x7f", "héllo wörld €", "\U0001f600" * 3, "\U0010ffff", " " * 64,
         "<s></s>", "{{ messages }}{% raw %}", "\n" * 10)
ROLES = ("system", "user", "assistant", "tool", "", "wizard", "USER", "\x00")


class FuzzRandom(random.Random):
    """A seeded source whose ``clean`` cases draw only in-range values, so that the paths behind
    validation (generation, allocation, sharing, forks) get their share of hostile traffic too."""

    clean = False


def text(rng: random.Random, *, oversize: int = 0) -> str:
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


def maybe(rng: random.Random, probability: float = 0.5) -> bool:
    return rng.random() < probability


def _sampling_fields(rng: random.Random) -> dict[str, object]:
    """Random values for the fields both SamplingParams messages share."""
    fields: dict[str, object] = {}
    for name in ("top_k", "min_tokens", "n"):
        if maybe(rng, 0.3):
            fields[name] = _int(rng)
    for name in ("min_p", "presence_penalty", "frequency_penalty", "temperature", "repetition_penalty", "top_p"):
        if maybe(rng, 0.3):
            fields[name] = _float(rng)
    # Small max_tokens keeps the valid cases cheap (n can be 64); the boundary values are rejected
    # up front. A 4,000-token request (n=16, max_tokens=257) once outlived a 30 s client deadline on a
    # busy machine: slow, not hung, but a fuzz tally must not depend on the machine's speed.
    fields["max_tokens"] = rng.choice((1, 2, 3, 4, 0, -1, -(2**31), 2**31 - 1, 100_000))
    if getattr(rng, "clean", False):
        fields["max_tokens"] = rng.randint(1, 4)
    if maybe(rng, 0.2):
        fields["seed"] = rng.choice((0, 1, 2**64 - 1, rng.getrandbits(64)))
    if maybe(rng, 0.2):
        fields["logprobs"] = _int(rng)
    if maybe(rng, 0.2):
        fields["ignore_eos"] = True
    if maybe(rng, 0.2):
        fields["stop"] = [text(rng) for _ in range(rng.choice((1, 2, 16, 17, 5000)))]
    if maybe(rng, 0.15):
        fields["stop_token_ids"] = [_int(rng) for _ in range(rng.choice((1, 3, 2000)))]
    if getattr(rng, "clean", False):
        fields["stop"] = fields.get("stop", [])[:2]
        fields["stop_token_ids"] = fields.get("stop_token_ids", [])[:2]
    if fields.get("n", 1) not in (0, 1) and "temperature" not in fields:
        fields["temperature"] = 1.0  # n > 1 is refused when greedy: exercise the real path too
    return fields


def gateway_request(rng: random.Random) -> gpb.GenerateRequest:
    request = gpb.GenerateRequest(params=gpb.SamplingParams(**_sampling_fields(rng)))
    if maybe(rng, 0.6):
        request.prompt = text(rng, oversize=(1 << 20) + 1)
    if maybe(rng, 0.5):
        num = rng.choice((1, 2, 3, 1025)) if maybe(rng, 0.9) else 5000
        request.messages.extend(gpb.ChatMessage(role=rng.choice(ROLES), content=text(rng)) for _ in range(num))
    if getattr(rng, "clean", False):  # exactly one of prompt or a few messages, known roles
        if request.prompt or not request.messages:
            del request.messages[:]
            request.prompt = request.prompt or "hi"
        else:
            for message in request.messages[:3]:
                message.role = rng.choice(ROLES[:4])
            del request.messages[3:]
    return _with_common_fields(rng, request)


def _with_common_fields(rng: random.Random, request: Request) -> Request:
    """Sometimes a request id, a cache salt and a priority: fields the gateway and compute share."""
    for name in ("request_id", "cache_salt"):
        if maybe(rng, 0.2):
            setattr(request, name, text(rng))
    if maybe(rng, 0.2):
        request.priority = _int(rng)
    return request


def compute_request(rng: random.Random, vocab_size: int) -> cpb.GenerateRequest:
    clean = getattr(rng, "clean", False)
    ids = [rng.randrange(vocab_size) for _ in range(rng.choice((1, 5, 40) if clean else (0, 1, 5, 40)))]
    if not clean and maybe(rng, 0.2):
        ids += [rng.choice((-1, vocab_size, 2**31 - 1, -(2**31)))]
    if not clean and maybe(rng, 0.03):
        ids = [1] * rng.choice((1024, 100_000))
    request = cpb.GenerateRequest(prompt_token_ids=ids, params=cpb.SamplingParams(**_sampling_fields(rng)))
    return _with_common_fields(rng, request)


def memory_request(rng: random.Random, client_id: str) -> tuple[str, Message]:
    """A MemoryManager call by (or pretending to be) the fuzzing client: mostly Steps."""
    pick = rng.random()
    if pick < 0.05:
        return "Attach", mpb.AttachRequest(client_name=text(rng), layout=mpb.KvLayout(
            num_layers=_int(rng), num_kv_heads=_int(rng), head_dim=_int(rng), dtype=rng.choice(("float32", "", "x")),
            block_size=_int(rng)))
    if pick < 0.1:
        return "GetBlockTable", mpb.GetBlockTableRequest(client_id=client_id, seq_id=_seq_id(rng))
    if pick < 0.13:
        return "Stats", mpb.StatsRequest()
    if getattr(rng, "clean", False):
        return "Step", mpb.StepRequest(client_id=client_id, ops=[_clean_memory_op(rng)])
    who = client_id if maybe(rng, 0.9) else text(rng)
    step = mpb.StepRequest(client_id=who)
    for section in (step.ops, step.late_ops):
        for _ in range(rng.choice((0, 1, 2, 5))):
            section.append(_memory_op(rng))
    if maybe(rng, 0.3):
        seq_ids = [_seq_id(rng) for _ in range(rng.choice((1, 2, 3)))]
        counts = [rng.choice((1, 2) if getattr(rng, "clean", False) else (0, 1, 2, 17, -1)) for _ in seq_ids]
        if not getattr(rng, "clean", False) and maybe(rng, 0.2):
            counts.append(1)  # lengths that disagree
        step.appends.CopyFrom(mpb.AppendBatch(seq_ids=seq_ids, num_tokens=counts,
                                              token_ids=[_int(rng) for _ in range(max(0, sum(counts)))]))
    return "Step", step


def _seq_id(rng: random.Random) -> str:
    if getattr(rng, "clean", False):
        return rng.choice(("s0", "s1", "s2", "s3"))
    return rng.choice(("s0", "s1", "s2", "s3", "", "s0/1", text(rng)))


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
        token_ids = [rng.randrange(50) for _ in range(rng.randint(1, 3))]
        return mpb.SequenceOp(append=mpb.AppendOp(seq_id=seq_id, token_ids=token_ids))
    if pick < 0.85:
        live.remove(seq_id)
        return mpb.SequenceOp(free=mpb.FreeOp(seq_id=seq_id))
    live.append(f"c{rng.getrandbits(32)}")
    return mpb.SequenceOp(fork=mpb.ForkOp(parent_seq_id=seq_id, child_seq_id=live[-1]))


def _memory_op(rng: random.Random) -> mpb.SequenceOp:
    kind = rng.choice(("allocate", "allocate", "append", "free", "free", "fork"))
    if kind == "allocate":
        tokens = [rng.randrange(50) for _ in range(rng.choice((0, 1, 5, 40, 300)))]
        if maybe(rng, 0.1):
            tokens.append(_int(rng))
        return mpb.SequenceOp(allocate=mpb.AllocateOp(
            seq_id=_seq_id(rng), prompt_token_ids=tokens or [1],
            max_num_new_tokens=rng.choice((1, 4, 16) if getattr(rng, "clean", False) else (1, 4, 16, 0, -1, 2**31 - 1)),
            priority=_int(rng) if maybe(rng, 0.2) else 0, namespace=text(rng) if maybe(rng, 0.2) else ""))
    if kind == "append":
        token_ids = [_int(rng) for _ in range(rng.choice((0, 1, 3, 33)))]
        return mpb.SequenceOp(append=mpb.AppendOp(seq_id=_seq_id(rng), token_ids=token_ids))
    if kind == "free":
        return mpb.SequenceOp(free=mpb.FreeOp(seq_id=_seq_id(rng)))
    return mpb.SequenceOp(fork=mpb.ForkOp(parent_seq_id=_seq_id(rng), child_seq_id=_seq_id(rng)))
