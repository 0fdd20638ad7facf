"""The rules of one generation request, in one place: each field's range, default and size bound.

Both edges check requests with these functions: the gateway (the public API) before any backend
work, and the compute service (its own API, which a caller may also reach directly) before the
engine; the engine's ``SamplingParams`` is checked by them too. Written once, the two cannot drift
apart. Pure Python (no torch, no protobuf): the gateway imports it, and each caller turns its own
wire message into the plain values checked here.

Why every repeated or sized field has a bound: the work and memory one request costs must not
grow with what a caller chooses to send (one request with two million stop ids once stalled the
whole engine, and an error echoing a megabyte role overflowed gRPC's metadata limit). So counts are
checked first, before any element is looked at, and every check is linear in the request. The
limits are what the compute service advertises in ``Info``; a gateway takes a backend's reported
limits where it reports them (``RequestLimits``), these defaults otherwise.

Messages name the field as the wire spells it (``params.stop_token_ids: at most 1024 ids, got
1025``) and echo at most ``errors.ECHO_CHARS`` of a value. Bad input raises ``InvalidArgument``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedserve.errors import InvalidArgument, echo
from pagedserve import grammar_limits

DEFAULT_MAX_TOKENS = 16
MAX_N = 64  # completions per request: n forks of the prompt, each with its own KV
MAX_LOGPROBS = 20  # a top-N sort per generated token
MAX_STOP_STRINGS = 16  # each searched in every completion's new text
MAX_STOP_STRING_CHARS = 256  # the text held back while a stop string may be half generated
MAX_STOP_TOKEN_IDS = 1024  # a set built once per request
MAX_REQUEST_ID_CHARS = 256  # ids appear in every log event
MAX_CACHE_SALT_CHARS = 256  # hashed into every prompt's prefix-cache namespace
MAX_TENANT_CHARS = 64  # a tenant's name: a metric label and a scheduling queue of the compute service
MAX_MESSAGES = 1024  # chat messages of one request
MAX_PROMPT_CHARS = 1 << 20  # a prompt, or the sum of its messages' contents
MAX_PROMPT_TOKENS = 1 << 18  # whatever the model's context: the wire limits are sized from it
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (as OpenAI's)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound: one index_put per step over every entry of the batch
MAX_LOGIT_BIAS = 100.0  # biases lie in [-100, 100] (OpenAI's: +-100 bans or forces a token)
ROLES = ("system", "user", "assistant", "tool")

# Bytes of a request or reply besides its prompt ids and the bounded fields above (sampling
# scalars, a chat template or grammar, a tokenizer chunk of 256 KiB): the margin of the wire limit.
MESSAGE_OVERHEAD_BYTES = 1 << 20
_MAX_VARINT_ID_BYTES = 5  # a non-negative int32 token id on the wire
_MAX_UTF8_BYTES = 4


@dataclass(frozen=True)
class RequestLimits:
    """The per-request bounds a compute service enforces (and reports in ``Info``)."""

    max_n: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        for name in ("max_logprobs", "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


DEFAULT_LIMITS = RequestLimits()


def max_message_bytes(max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> int:
    """The largest compute-service request (or reply) that a valid request can need.

    A prompt of ``max_prompt_tokens`` ids, every bounded field at its limit, and the overhead
    margin: a wire limit sized from the model's limits rather than a flat 64 MiB, so that a
    request far beyond them is refused by gRPC before it is parsed at all.
    """
    ids = (max_prompt_tokens + MAX_STOP_TOKEN_IDS) * _MAX_VARINT_ID_BYTES
    strings = (MAX_STOP_STRINGS * MAX_STOP_STRING_CHARS + MAX_REQUEST_ID_CHARS + MAX_CACHE_SALT_CHARS
               + MAX_TENANT_CHARS) * _MAX_UTF8_BYTES
    return ids + strings + MESSAGE_OVERHEAD_BYTES


# --- sampling fields ------------------------------------------------------------------------------


# The default of each sampling field: what an unset field means, on every wire and in the engine.
SAMPLING_DEFAULTS: Mapping[str, object] = {
    "max_tokens": DEFAULT_MAX_TOKENS, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
    "stop": (), "stop_token_ids": (), "ignore_eos": False, "min_tokens": 0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1, "logprobs": None, "logit_bias": (),
    "prompt_logprobs": None, "pooling": None,
}
# An embedding request's pooling of the final hidden states (SamplingParams.pooling).
POOLING_TYPES = ("last", "mean")


def resolve_sampling(given: Mapping[str, object]) -> dict[str, object]:
    """The sampling fields with their defaults applied: the one place that says what "unset" means.

    Args:
        given: field name to value, None (or absent) for unset; names outside ``SAMPLING_DEFAULTS``
            are ignored.
    Returns:
        Every field of ``SAMPLING_DEFAULTS`` (what ``check_sampling`` and the engine's
        ``SamplingParams`` take).
    """
    resolved = dict(SAMPLING_DEFAULTS)
    resolved.update((name, value) for name, value in given.items() if value is not None and name in resolved)
    return resolved



def check_range(name: str, value: float, low: float | None, high: float | None, *, low_open: bool = False) -> None:
    """``value`` is finite and within ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {echo(value)}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        bounds = f"in {left}{low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
        raise InvalidArgument(f"{name} must be {bounds}, got {echo(value)}")


def check_counts(num_stop: int, num_stop_token_ids: int, *, prefix: str = "params.",
                 limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """The repeated sampling fields' lengths: checked before any element is copied or looked at."""
    if num_stop > limits.max_stop_strings:
        raise InvalidArgument(f"{prefix}stop: at most {limits.max_stop_strings} strings, got {num_stop}")
    if num_stop_token_ids > limits.max_stop_token_ids:
        raise InvalidArgument(f"{prefix}stop_token_ids: at most {limits.max_stop_token_ids} ids, "
                              f"got {num_stop_token_ids}")


def logit_bias_pairs(logit_bias: Mapping[int, float] | Sequence[tuple[int, float]]) -> Sequence[tuple[int, float]]:
    """``(token id, bias)`` pairs of a logit_bias given as a mapping (the wires') or as pairs (the engine's)."""
    return list(logit_bias.items()) if isinstance(logit_bias, Mapping) else logit_bias


def check_logit_bias(logit_bias: Mapping[int, float] | Sequence[tuple[int, float]], *, prefix: str = "params.",
                     vocab_size: int | None = None) -> None:
    """At most ``MAX_LOGIT_BIAS_ENTRIES`` entries (counted first), each a token id in the vocabulary
    and a finite bias in [-100, 100]."""
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(f"{prefix}logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(logit_bias)}")
    pairs = logit_bias_pairs(logit_bias)
    check_token_ids(f"{prefix}logit_bias", [token_id for token_id, _ in pairs], vocab_size)
    for token_id, bias in pairs:
        check_range(f"{prefix}logit_bias[{token_id}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)


def check_sampling(values: Mapping[str, object], *, prefix: str = "params.", limits: RequestLimits = DEFAULT_LIMITS,
                   vocab_size: int | None = None) -> None:
    """Every sampling field, defaults already applied (the engine's ``SamplingParams`` fields).

    Args:
        values: max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids,
            min_tokens, repetition_penalty, presence_penalty, frequency_penalty, n, logprobs, logit_bias,
            prompt_logprobs, pooling (absent: None). With prompt_logprobs, max_tokens may be 0: the
            prompt is scored and nothing generated (then n must be 1: there is nothing to fork);
            pooling (an embedding) needs max_tokens 0 and n 1.
        prefix: put before each field's name in messages (``params.`` as the wires spell it).
        limits: the bounds (the compute service's own, or what a backend reported).
        vocab_size: stop token ids must be below it (None: only >= 0 is checked).
    Raises:
        InvalidArgument: naming the first bad field.
    """
    v = values
    check_counts(len(v["stop"]), len(v["stop_token_ids"]), prefix=prefix, limits=limits)
    prompt_logprobs, pooling = v.get("prompt_logprobs"), v.get("pooling")
    is_prompt_only = prompt_logprobs is not None or pooling is not None
    check_range(f"{prefix}max_tokens", v["max_tokens"], 0 if is_prompt_only else 1, None)
    check_range(f"{prefix}temperature", v["temperature"], 0.0, None)
    check_range(f"{prefix}top_p", v["top_p"], 0.0, 1.0, low_open=True)
    check_range(f"{prefix}top_k", v["top_k"], 0, None)
    check_range(f"{prefix}min_p", v["min_p"], 0.0, 1.0)
    check_range(f"{prefix}repetition_penalty", v["repetition_penalty"], 0.0, None, low_open=True)
    check_range(f"{prefix}presence_penalty", v["presence_penalty"], -MAX_PENALTY, MAX_PENALTY)
    check_range(f"{prefix}frequency_penalty", v["frequency_penalty"], -MAX_PENALTY, MAX_PENALTY)
    check_range(f"{prefix}min_tokens", v["min_tokens"], 0, v["max_tokens"])
    check_range(f"{prefix}n", v["n"], 1, limits.max_n)
    if v["logprobs"] is not None:
        check_range(f"{prefix}logprobs", v["logprobs"], 0, limits.max_logprobs)
    if prompt_logprobs is not None:
        check_range(f"{prefix}prompt_logprobs", prompt_logprobs, 0, limits.max_logprobs)
        if v["max_tokens"] == 0 and v["n"] != 1:
            raise InvalidArgument(f"{prefix}n must be 1 with max_tokens 0 (only the prompt is scored), "
                                  f"got {echo(v['n'])}")
    if pooling is not None:
        if pooling not in POOLING_TYPES:
            raise InvalidArgument(f"{prefix}pooling must be one of {', '.join(POOLING_TYPES)}, got {echo(pooling)}")
        # The first field that an embedding, which generates nothing, cannot take, named with its value.
        for name, value, allowed in (("max_tokens", v["max_tokens"], 0), ("n", v["n"], 1),
                                     ("logprobs", v["logprobs"], None), ("prompt_logprobs", prompt_logprobs, None)):
            if value != allowed:
                raise InvalidArgument(f"{prefix}pooling: an embedding generates nothing (max_tokens 0, n 1, no "
                                      f"logprobs), got {prefix}{name} {echo(value)} with pooling {echo(pooling)}")
    if v["seed"] is not None and not 0 <= v["seed"] < 2**64:
        raise InvalidArgument(f"{prefix}seed must be in [0, 2**64), got {echo(v['seed'])}")
    for i, stop in enumerate(v["stop"]):
        if not stop or len(stop) > limits.max_stop_string_chars:
            raise InvalidArgument(f"{prefix}stop[{i}] must have 1 to {limits.max_stop_string_chars} characters, "
                                  f"got {len(stop)}")
    check_token_ids(f"{prefix}stop_token_ids", v["stop_token_ids"], vocab_size)
    check_logit_bias(v.get("logit_bias", ()), prefix=prefix, vocab_size=vocab_size)


def check_token_ids(name: str, token_ids: Sequence[int], vocab_size: int | None) -> None:
    """Every id in ``[0, vocab_size)``: ``min``/``max`` run in C, so a long prompt costs microseconds
    per thousand ids; the bad id itself is looked for only once one is known to exist."""
    if not token_ids:
        return
    low, high = min(token_ids), max(token_ids)
    if low >= 0 and (vocab_size is None or high < vocab_size):
        return
    i, bad = next((i, t) for i, t in enumerate(token_ids) if t < 0 or (vocab_size is not None and t >= vocab_size))
    bounds = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
    raise InvalidArgument(f"{name}[{i}] must be {bounds}, got {echo(bad)}")


def check_string_id(name: str, value: str, max_chars: int) -> None:
    """A request id or cache salt: at most ``max_chars`` printable characters (they reach logs)."""
    if len(value) > max_chars:
        raise InvalidArgument(f"{name}: at most {max_chars} characters, got {len(value)}")
    if not value.isprintable():
        raise InvalidArgument(f"{name}: printable characters only, got {echo(value)}")


def check_ids(request_id: str, cache_salt: str) -> None:
    check_string_id("request_id", request_id, MAX_REQUEST_ID_CHARS)
    check_string_id("cache_salt", cache_salt, MAX_CACHE_SALT_CHARS)


# --- structured-output constraints ---------------------------------------------------------------
# The gateway has no grammar engine: it checks the kind and the sizes, so an oversized constraint
# costs the backends nothing; the compute service checks them again, then compiles. Sizes bound the
# compile work together with the compute service's compile timeout (some shapes compile in more
# than linear time: a JSON schema's optional properties, cubically).

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # the wire's oneof
MAX_JSON_SCHEMA_CHARS = 32768
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 32768
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
_MAX_SPEC_CHARS = {"json_schema": MAX_JSON_SCHEMA_CHARS, "regex": MAX_REGEX_CHARS, "grammar": MAX_GRAMMAR_CHARS}


def check_constraint(kind: str, spec: str = "", choices: Sequence[str] = (), *, prefix: str = "params.",
                     name: str | None = None) -> None:
    """A constraint's kind and sizes (not its validity: that is the grammar compiler's verdict).

    Args:
        kind: one of CONSTRAINT_KINDS; spec: the schema, regex or grammar text ("" for the others);
        choices: a choice constraint's alternatives; prefix: put before the field's name;
        name: the field's name in messages when it is not ``prefix + kind`` (the HTTP API's).
    """
    name = name or prefix + kind
    if kind not in CONSTRAINT_KINDS:
        raise InvalidArgument(f"{prefix}constraint: unknown kind {echo(kind)}; one of {', '.join(CONSTRAINT_KINDS)}")
    if kind in _MAX_SPEC_CHARS:
        if len(spec) > _MAX_SPEC_CHARS[kind]:
            raise InvalidArgument(f"{name}: at most {_MAX_SPEC_CHARS[kind]} characters, got {len(spec)}")
        if not spec.strip():
            raise InvalidArgument(f"{name} must not be empty")
        grammar_limits.check_spec(kind, spec, name)
    elif kind == "choice":
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidArgument(f"{name}.choices must hold 1 to {MAX_CHOICES} strings, got {len(choices)}")
        for i, choice in enumerate(choices):
            if not 1 <= len(choice) <= MAX_CHOICE_CHARS:
                raise InvalidArgument(f"{name}.choices[{i}] must have 1 to {MAX_CHOICE_CHARS} characters, "
                                      f"got {len(choice)}")


def check_constrained_sampling(kind: str, *, ignore_eos: bool, min_tokens: int, pooling: str | None = None,
                               prefix: str = "params.") -> None:
    """The grammar decides where a constrained output ends: no ignore_eos, no min_tokens; and an
    embedding (``pooling``) generates nothing for a constraint to shape."""
    if pooling:
        raise InvalidArgument(f"{prefix}pooling cannot be combined with {kind}: an embedding generates nothing, "
                              f"got pooling {echo(pooling)}")
    for name, value in (("ignore_eos", ignore_eos), ("min_tokens", min_tokens)):
        if value:
            raise InvalidArgument(f"{prefix}{name} cannot be combined with {kind}: "
                                  "the grammar decides where the output ends")


# --- prompt ---------------------------------------------------------------------------------------


def check_messages(roles_and_contents: Sequence[tuple[str, str]], *, max_messages: int = MAX_MESSAGES,
                   max_chars: int = MAX_PROMPT_CHARS) -> None:
    """Chat messages: their number first, then each role, then their total size."""
    if len(roles_and_contents) > max_messages:
        raise InvalidArgument(f"messages: at most {max_messages} messages, got {len(roles_and_contents)}")
    num_chars = 0
    for i, (role, content) in enumerate(roles_and_contents):
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {echo(role)}")
        num_chars += len(content)
    if num_chars > max_chars:
        raise InvalidArgument(f"messages: at most {max_chars} characters in all, got {num_chars}")


def check_prompt_chars(prompt: str, max_chars: int = MAX_PROMPT_CHARS) -> None:
    if len(prompt) > max_chars:
        raise InvalidArgument(f"prompt: at most {max_chars} characters, got {len(prompt)}")


def check_prompt_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, *,
                        field: str = "prompt_token_ids", max_tokens_field: str = "params.max_tokens") -> None:
    """The prompt is non-empty and, with ``max_tokens``, fits the model: lengths only, no ids read."""
    if num_prompt_tokens == 0:
        raise InvalidArgument(f"{field}: must have at least one token")
    limit = min(max_model_len, MAX_PROMPT_TOKENS)
    if num_prompt_tokens > limit:
        raise InvalidArgument(f"{field}: at most {limit} tokens (the model's maximum length), got {num_prompt_tokens}")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidArgument(
            f"{max_tokens_field}: the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
            f"exceeds the model's maximum length ({max_model_len})"
        )


# --- what a request costs -------------------------------------------------------------------------


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens, ``block_size`` a block: the last one may be partly
    filled (ceil division). The one statement of it, for the scheduler, the block manager and the
    capacity check alike."""
    return -(-num_tokens // block_size)


def kv_blocks_needed(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """KV blocks a request holds at its largest: the prompt's full blocks are shared by its ``n``
    completions; each completion has its own copy of the prompt's last partial block and its own
    blocks for up to ``max_tokens`` new tokens."""
    shared = num_prompt_tokens // block_size
    own = num_blocks_for(num_prompt_tokens % block_size + max_tokens, block_size)
    return shared + n * own


def check_capacity(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int, num_blocks: int) -> None:
    """Refuse what can never fit the pool at once: it would wait, or be preempted, forever."""
    needed = kv_blocks_needed(num_prompt_tokens, max_tokens, n, block_size)
    if needed <= num_blocks:
        return
    if n > 1:
        raise InvalidArgument(
            f"params.n: {n} completions of max_tokens ({max_tokens}) after the prompt ({num_prompt_tokens} tokens) "
            f"need {needed} blocks at once, more than the KV pool's {num_blocks}; lower params.n or params.max_tokens"
        )
    raise InvalidArgument(
        f"params.max_tokens: the prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
        f"exceed the KV pool's {num_blocks * block_size} tokens"
    )


def min_reply_bytes(n: int, max_tokens: int, logprobs: int | None) -> int:
    """The smallest a unary reply of ``n`` completions of ``max_tokens`` tokens can be on the wire:
    per token at least one byte of id (its text may be empty), and with logprobs an entry of at
    least its header and the packed top ids (a byte each) and values (four bytes each). A bound from
    below, so that what is refused up front could never have been sent."""
    per_token = 1
    if logprobs is not None:
        per_token += 2  # the entry's tag and length (token_id and logprob may be zeros, left out)
        if logprobs:
            per_token += (2 + logprobs) + (2 + 4 * logprobs)
    return n * max_tokens * per_token


def check_reply_fits(n: int, max_tokens: int, logprobs: int | None, max_bytes: int,
                     stream_hint: str = "use GenerateStream") -> None:
    """A unary reply that cannot fit the send limit is refused before any work: stream it
    (``stream_hint`` says how on the caller's API)."""
    size = min_reply_bytes(n, max_tokens, logprobs)
    if size > max_bytes:
        raise InvalidArgument(
            f"params.n, params.max_tokens, params.logprobs: a reply of n ({n}) x max_tokens ({max_tokens}) tokens "
            f"with logprobs ({logprobs}) takes at least {size} bytes, more than the {max_bytes} one unary reply may "
            f"carry; {stream_hint}, or lower them"
        )
