"""Checks a public request before any backend work and converts it to the compute service's request.

Everything that can be checked here is: a bad request costs the backends nothing, and the error
names the field (``ValueError``, mapped to INVALID_ARGUMENT by the server's interceptor). The
limits come from the backend's ``Info``, so they are the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config import GatewayConfig
from pagedserve.compute.v1 import compute_pb2
from pagedserve.gateway.v1 import gateway_pb2

_ROLES = ("system", "user", "assistant", "tool")
_MAX_ID_CHARS = 256
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class PromptInput:
    """What to tokenize: a plain prompt, or chat messages (exactly one is set)."""

    prompt: str | None
    messages: list[dict[str, str]] | None

    @property
    def num_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m["content"]) for m in self.messages or ())


def check_prompt_input(request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest,
                       config: GatewayConfig) -> PromptInput:
    """Exactly one of prompt or messages, within the size limits, roles known."""
    if bool(request.prompt) == bool(request.messages):
        raise ValueError("prompt, messages: give exactly one of them")
    if request.messages:
        if len(request.messages) > config.max_messages:
            raise ValueError(f"messages: at most {config.max_messages} messages, got {len(request.messages)}")
        for i, message in enumerate(request.messages):
            if message.role not in _ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {message.role!r}")
        given = PromptInput(None, [{"role": m.role, "content": m.content} for m in request.messages])
    else:
        given = PromptInput(request.prompt, None)
    if given.num_chars > config.max_prompt_chars:
        field = "prompt" if given.prompt is not None else "messages"
        raise ValueError(f"{field}: at most {config.max_prompt_chars} characters, got {given.num_chars}")
    return given


def check_request(request: gateway_pb2.GenerateRequest, info: compute_pb2.InfoResponse) -> None:
    """Every field of the request besides the prompt, against the model's limits."""
    for name in ("request_id", "cache_salt"):
        value = getattr(request, name)
        if len(value) > _MAX_ID_CHARS or not value.isprintable():
            raise ValueError(f"{name}: at most {_MAX_ID_CHARS} printable characters")
    p = request.params
    _check_range("params.max_tokens", p.max_tokens, 0, None)
    if p.HasField("temperature"):
        _check_range("params.temperature", p.temperature, 0.0, None)
    _check_range("params.top_p", p.top_p, 0.0, 1.0)
    _check_range("params.top_k", p.top_k, 0, None)
    _check_range("params.min_p", p.min_p, 0.0, 1.0)
    _check_range("params.repetition_penalty", p.repetition_penalty, 0.0, None)
    _check_range("params.presence_penalty", p.presence_penalty, -2.0, 2.0)
    _check_range("params.frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    _check_range("params.n", p.n, 0, info.max_n or None)
    _check_range("params.min_tokens", p.min_tokens, 0, p.max_tokens or DEFAULT_MAX_TOKENS)
    if p.HasField("logprobs"):
        _check_range("params.logprobs", p.logprobs, 0, info.max_logprobs or None)
    if info.max_stop_strings and len(p.stop) > info.max_stop_strings:
        raise ValueError(f"params.stop: at most {info.max_stop_strings} strings, got {len(p.stop)}")
    for i, stop in enumerate(p.stop):
        if not stop:
            raise ValueError(f"params.stop[{i}] must not be empty")
    for i, token_id in enumerate(p.stop_token_ids):
        _check_range(f"params.stop_token_ids[{i}]", token_id, 0, info.vocab_size - 1)


def check_length(num_prompt_tokens: int, request: gateway_pb2.GenerateRequest, info: compute_pb2.InfoResponse) -> None:
    """The tokenized prompt is non-empty and, with max_tokens, fits the model."""
    field = "prompt" if request.prompt else "messages"
    if num_prompt_tokens == 0:
        raise ValueError(f"{field}: tokenizes to no tokens")
    max_tokens = request.params.max_tokens or DEFAULT_MAX_TOKENS
    if info.max_model_len and num_prompt_tokens + max_tokens > info.max_model_len:
        raise ValueError(
            f"params.max_tokens: the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
            f"exceeds the model's maximum length ({info.max_model_len})"
        )


def to_compute_request(request: gateway_pb2.GenerateRequest, prompt_token_ids: list[int],
                       backend_request_id: str) -> compute_pb2.GenerateRequest:
    """The compute service's request; public zeros become "unset" so the model's defaults apply."""
    p = request.params
    params = compute_pb2.SamplingParams(
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        top_k=p.top_k,
        min_p=p.min_p,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop=p.stop,
        n=p.n,
    )
    if p.HasField("temperature"):
        params.temperature = p.temperature
    if p.top_p:
        params.top_p = p.top_p
    if p.repetition_penalty:
        params.repetition_penalty = p.repetition_penalty
    if p.HasField("seed"):
        params.seed = p.seed
    if p.HasField("logprobs"):
        params.logprobs = p.logprobs
    return compute_pb2.GenerateRequest(
        request_id=backend_request_id,
        prompt_token_ids=prompt_token_ids,
        params=params,
        priority=request.priority,
        cache_salt=request.cache_salt,
    )


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
