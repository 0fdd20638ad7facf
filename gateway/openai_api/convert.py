"""OpenAI request bodies to the public ``GenerateRequest``, and the public answers back to OpenAI JSON.

The edge of the HTTP front, as ``from_pb``/``to_pb`` are the gRPC servicer's: nothing here decides
what is valid beyond what the JSON shape and the proto's "zero means default" encoding force. The
few rules of that kind (``n: 0`` would read as "unset", so it is refused here) are listed in
``_zero_means_default``; every other bound is ``gateway.validation``'s, on the converted request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.openai_api.constraints import set_constraint
from gateway.openai_api.schema import ChatCompletionRequest, CompletionRequest
from pagedserve.errors import InvalidArgument
from pagedserve.gateway.v1 import gateway_pb2

# Logprobs of -inf (a token the sampler could never pick) are not valid JSON: vLLM's clamp.
MIN_LOGPROB = -9999.0
# The finish reasons of the public API, as OpenAI's. "eos" is a stop at the end-of-sequence token;
# "abort" (the backend dropped the request: the gateway shut down, the engine restarted) has no
# OpenAI value and stays "abort", as vLLM sends it.
FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length", "abort": "abort"}
# Chat roles OpenAI has that the public API names otherwise.
_ROLE_ALIASES = {"developer": "system"}


class ParamError(InvalidArgument):
    """Bad input naming the OpenAI parameter (the error body's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: the public request, its token ids when it was given as ids, and
    the OpenAI parameter that gave its constraint (the compute service's verdict on it names it)."""

    request: gateway_pb2.GenerateRequest
    token_ids: list[int] | None
    constraint_param: str | None = None


def _zero_means_default(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> None:
    """Values the proto would read as "unset" (its zero) rather than as what the client said."""
    if max_tokens is not None and max_tokens < 1:
        raise ParamError("max_tokens", f"max_tokens must be >= 1, got {max_tokens}")
    if body.n is not None and body.n < 1:
        raise ParamError("n", f"n must be >= 1, got {body.n}")
    if body.top_p is not None and not body.top_p > 0:
        raise ParamError("top_p", f"top_p must be in (0, 1], got {body.top_p}")
    if body.repetition_penalty is not None and not body.repetition_penalty > 0:
        raise ParamError("repetition_penalty", f"repetition_penalty must be > 0, got {body.repetition_penalty}")


def _set(target: object, name: str, value: object, param: str | None = None) -> None:
    """Assigns a proto field; protobuf's own range errors (an int32 overflow) name the parameter."""
    try:
        if isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    except (ValueError, TypeError) as exc:
        raise ParamError(param or name, f"{param or name}: {exc}") from None


def _params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
            logprobs: int | None) -> tuple[gateway_pb2.SamplingParams, str | None]:
    """The sampling parameters, and the OpenAI parameter that gave their constraint (None: none)."""
    if body.logit_bias:
        raise ParamError("logit_bias", "logit_bias is not supported")
    _zero_means_default(body, max_tokens)
    params = gateway_pb2.SamplingParams()
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    top_k = 0 if body.top_k == -1 else body.top_k  # vLLM's -1 means "all", as 0 does here
    for name, value in (("max_tokens", max_tokens), ("temperature", body.temperature), ("top_p", body.top_p),
                        ("top_k", top_k), ("min_p", body.min_p), ("seed", body.seed), ("stop", stop),
                        ("stop_token_ids", body.stop_token_ids), ("repetition_penalty", body.repetition_penalty),
                        ("presence_penalty", body.presence_penalty), ("frequency_penalty", body.frequency_penalty),
                        ("logprobs", logprobs), ("n", body.n), ("ignore_eos", body.ignore_eos),
                        ("min_tokens", body.min_tokens)):
        if value is not None:
            _set(params, name, value)
    return params, set_constraint(body, params)


def _request(body: CompletionRequest | ChatCompletionRequest, params: gateway_pb2.SamplingParams,
             request_id: str) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(params=params, request_id=request_id)
    _set(request, "priority", body.priority or 0, "priority")
    _set(request, "cache_salt", body.cache_salt or "", "cache_salt")
    return request


def completion_prompts(body: CompletionRequest, request_id: str) -> list[Prompt]:
    """One public request per prompt of a completions body (a list of prompts is a batch)."""
    if body.echo:
        raise ParamError("echo", "echo is not supported")
    if body.suffix:
        raise ParamError("suffix", "suffix is not supported")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise ParamError("best_of", "best_of other than n is not supported")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts: Sequence[str | list[int]] = [prompt]  # type: ignore[list-item]
    else:
        prompts = prompt  # type: ignore[assignment]
    if not prompts:
        raise ParamError("prompt", "prompt must not be empty")
    params, constraint_param = _params(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs)
    out = []
    for i, one in enumerate(prompts):
        request = _request(body, params, request_id if len(prompts) == 1 else f"{request_id}-{i}")
        if isinstance(one, str):
            request.prompt = one
            out.append(Prompt(request, None, constraint_param))
        else:
            out.append(Prompt(request, list(one), constraint_param))
    return out


def chat_prompt(body: ChatCompletionRequest, request_id: str) -> Prompt:
    """The public request of a chat body."""
    if body.tools or (body.tool_choice is not None and body.tool_choice != "none") or body.functions \
            or body.function_call is not None:
        raise ParamError("tools", "tools and tool_choice are not supported yet")
    if body.top_logprobs is not None and not body.logprobs:
        raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params, constraint_param = _params(body, max_tokens, logprobs)
    request = _request(body, params, request_id)
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ParamError(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        role = _ROLE_ALIASES.get(message.role, message.role)
        request.messages.append(gateway_pb2.ChatMessage(role=role, content=content or ""))
    return Prompt(request, None, constraint_param)


def finish_reason(reason: str) -> str | None:
    return FINISH_REASONS.get(reason, reason) if reason else None


def _clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def chat_logprobs(items: Sequence[gateway_pb2.TokenLogprobs], decode: Callable[[int], str]) -> dict:
    """OpenAI chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(item.token_id, item.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in zip(item.top_token_ids, item.top_logprobs)]}
                        for item in items]}


def completion_logprobs(items: Sequence[gateway_pb2.TokenLogprobs], decode: Callable[[int], str],
                        offset: int = 0) -> dict:
    """OpenAI completions logprobs: parallel ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    Args:
        offset: characters of this completion already sent (a stream's earlier pieces).
    """
    tokens, offsets = [], []
    for item in items:
        tokens.append(decode(item.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_clamp(item.logprob) for item in items],
            "top_logprobs": [{decode(t): _clamp(lp) for t, lp in zip(item.top_token_ids, item.top_logprobs)}
                             for item in items],
            "text_offset": offsets}


def usage(items: Sequence[gateway_pb2.Usage]) -> dict:
    """OpenAI usage of one or more public requests (a batch of prompts sums them)."""
    prompt = sum(u.prompt_tokens for u in items)
    completion = sum(u.completion_tokens for u in items)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in items)}}
