"""OpenAI request bodies to the gateway core's ``GenerateRequest``, and its answers back to OpenAI JSON.

The edge of the HTTP front, as ``gateway.grpc.convert`` is the gRPC servicer's: nothing here decides
what is valid beyond the JSON shape; every bound is the core's ``validate``, on the converted
request, whose messages name the gRPC field (``params.n``) and which the app maps to the OpenAI
parameter. Unlike the gRPC wire, a value here is what the client wrote: ``n: 0`` is a bad ``n``,
not "unset".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.core.types import ChatMessage, GenerateRequest, SamplingOptions, TokenLogprobs, Tool, ToolCall, Usage
from gateway.openai_api.constraints import constraint_of
from gateway.openai_api.errors import ParamError
from gateway.openai_api import schema
from pagedserve import sampling_rules as rules
from pagedserve.errors import echo
from gateway.openai_api.schema import ChatCompletionRequest, CompletionRequest

__all__ = ["ParamError", "Prompt", "chat_prompt", "completion_prompts", "num_prompts", "tokenize_request"]

# Logprobs of -inf (a token the sampler could never pick) are not valid JSON: vLLM's clamp.
MIN_LOGPROB = -9999.0
# The finish reasons of the public API, as OpenAI's. "eos" is a stop at the end-of-sequence token;
# "abort" (the backend dropped the request: the gateway shut down, the engine restarted) has no
# OpenAI value and stays "abort", as vLLM sends it.
FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length", "abort": "abort", "tool_calls": "tool_calls"}
# Chat roles OpenAI has that the public API names otherwise.
_ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: the core's request (a prompt given as token ids in
    ``prompt_token_ids``) and the OpenAI parameter that gave its constraint (the compute service's
    verdict on it names it)."""

    request: GenerateRequest
    constraint_param: str | None = None


def _options(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
             logprobs: int | None, prompt_logprobs: int | None = None) -> tuple[SamplingOptions, str | None]:
    """The sampling options, and the OpenAI parameter that gave their constraint (None: none)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    constraint, constraint_param = constraint_of(body)
    options = SamplingOptions(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=0 if body.top_k == -1 else body.top_k,  # vLLM's -1 means "all", as 0 does here
        min_p=body.min_p, seed=body.seed, stop=stop, stop_token_ids=list(body.stop_token_ids or ()),
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logprobs=logprobs, n=body.n, ignore_eos=bool(body.ignore_eos),
        min_tokens=body.min_tokens, constraint=constraint, logit_bias=_logit_bias(body.logit_bias),
        prompt_logprobs=prompt_logprobs)
    return options, constraint_param


def _prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """vLLM's prompt_logprobs: the prompt scored, in the whole answer only (as vLLM has it)."""
    if body.prompt_logprobs is not None and body.stream:
        raise ParamError("prompt_logprobs", "prompt_logprobs are not available with stream: true")
    return body.prompt_logprobs


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON keys, so strings) as ids; the core checks the ids and biases."""
    if not given:
        return None
    if len(given) > rules.MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError("logit_bias", f"logit_bias: at most {rules.MAX_LOGIT_BIAS_ENTRIES} entries, got {len(given)}")
    bias = {}
    for key, value in given.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {echo(key)}") from None
    return bias


def _request(body: CompletionRequest | ChatCompletionRequest, options: SamplingOptions,
             request_id: str) -> GenerateRequest:
    return GenerateRequest(options=options, request_id=request_id, priority=body.priority or 0,
                           cache_salt=body.cache_salt or "")


def prompt_list(given: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> Sequence[str | list[int]]:
    """The prompts of a completions ``prompt`` or an embeddings ``input``: a string or a flat list of
    ids is one; a list of strings or of id lists is a batch. Nothing copied or converted."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]  # type: ignore[list-item]
    return given  # type: ignore[return-value]


def with_prompt(request: GenerateRequest, prompt: str | list[int]) -> GenerateRequest:
    """``request`` with its prompt: a text, or token ids."""
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids = list(prompt)
    return request


def num_prompts(body: CompletionRequest) -> int:
    """How many prompts a completions body holds, counted without converting any."""
    return len(prompt_list(body.prompt))


def completion_prompts(body: CompletionRequest, request_id: str) -> list[Prompt]:
    """One core request per prompt of a completions body (a list of prompts is a batch)."""
    if body.suffix:
        raise ParamError("suffix", "suffix is not supported")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise ParamError("best_of", "best_of other than n is not supported")
    prompts = prompt_list(body.prompt)
    if not prompts:
        raise ParamError("prompt", "prompt must not be empty")
    # echo with logprobs scores the prompt too (its tokens lead the choice's logprobs); with
    # max_tokens 0 only the prompt is scored (what lm-evaluation-harness's loglikelihood asks).
    prompt_logprobs = _prompt_logprobs(body)
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs or 0)
    # unset max_tokens: the API's default (16)
    options, constraint_param = _options(body, body.max_tokens, body.logprobs, prompt_logprobs)
    out = []
    for i, one in enumerate(prompts):
        request = _request(body, options, request_id if len(prompts) == 1 else f"{request_id}-{i}")
        out.append(Prompt(with_prompt(request, one), constraint_param))
    return out


def chat_prompt(body: ChatCompletionRequest, request_id: str) -> Prompt:
    """The core request of a chat body."""
    if body.functions or body.function_call is not None:
        raise ParamError("functions", "functions and function_call are deprecated and not supported; "
                                      "use tools and tool_choice")
    if body.top_logprobs is not None and not body.logprobs:
        raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    options, constraint_param = _options(body, max_tokens, logprobs, _prompt_logprobs(body))
    request = _request(body, options, request_id)
    request.messages = _messages(body.messages)
    _tools(body, request)
    if request.tool_choice in ("required", "function") and constraint_param is None:
        constraint_param = "tools"  # the grammar built from them: the engine's verdict on it names them
    return Prompt(request, constraint_param)


def _tools(body: ChatCompletionRequest, request: GenerateRequest) -> None:
    """The body's tools and tool choice into the request (the core checks them)."""
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.type != "function":
                raise ParamError("tools", f"tools[{i}].type must be 'function', got {echo(tool.type)}")
            f = tool.function
            parameters = json.dumps(f.parameters) if f.parameters is not None else ""
            tools.append(Tool(f.name, f.description or "", parameters))
        request.tools = tools
    choice = body.tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ParamError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                            '{"type": "function", "function": {"name": ...}}')
        request.tool_choice, request.tool_function = "function", function["name"]
    elif choice is not None:
        if choice not in ("none", "auto", "required"):
            raise ParamError("tool_choice", f'tool_choice must be "none", "auto", "required" or a function, '
                                            f"got {echo(choice)}")
        request.tool_choice = choice
    request.parallel_tool_calls = body.parallel_tool_calls


def _messages(messages: Sequence[schema.ChatMessage]) -> list[ChatMessage]:
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ParamError(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        calls = tuple(ToolCall(c.id or "", c.function.name, c.function.arguments) for c in message.tool_calls or ())
        out.append(ChatMessage(_ROLE_ALIASES.get(message.role, message.role), content or "", calls,
                               message.tool_call_id or ""))
    return out


def tool_call_json(call: ToolCall) -> dict:
    """A call as OpenAI's message and delta carry it."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tokenize_request(body: schema.TokenizeRequest) -> GenerateRequest:
    """The core request of a ``/tokenize`` body (the core checks that exactly one is given)."""
    return GenerateRequest(prompt=body.prompt, messages=_messages(body.messages) if body.messages else None)


def finish_reason(reason: str) -> str | None:
    return FINISH_REASONS.get(reason, reason) if reason else None


def _clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def chat_logprobs(items: Sequence[TokenLogprobs], decode: Callable[[int], str]) -> dict:
    """OpenAI chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(item.token_id, item.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in zip(item.top_token_ids, item.top_logprobs)]}
                        for item in items]}


def completion_logprobs(items: Sequence[TokenLogprobs], decode: Callable[[int], str],
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


def echo_logprobs(prompt_token_ids: Sequence[int], scored: Sequence[TokenLogprobs], num_top: int,
                  decode: Callable[[int], str]) -> dict:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy shape): every prompt
    token, the first without a logprob (``None``: nothing comes before it), the others with the
    logprob the model gave them and their ``num_top`` most likely alternatives; offsets from 0.

    Args:
        prompt_token_ids: the L prompt tokens; scored: tokens 1..L-1 (empty for a one-token prompt).
    """
    tokens = [decode(t) for t in prompt_token_ids]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None] + [_clamp(lp.logprob) for lp in scored],
            "top_logprobs": [None] + [{decode(t): _clamp(v) for t, v in
                                       zip(lp.top_token_ids[:num_top], lp.top_logprobs[:num_top])} for lp in scored],
            "text_offset": offsets}


def vllm_prompt_logprobs(scored: Sequence[TokenLogprobs], decode: Callable[[int], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a dict keyed by
    token id (JSON text) of ``{logprob, rank, decoded_token}``, the prompt token and its position's
    most likely tokens (their rank is their place among them)."""
    out: list[dict | None] = [None]
    for lp in scored:
        entry = {str(lp.token_id): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                                    "decoded_token": decode(lp.token_id)}}
        for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            entry.setdefault(str(t), {"logprob": _clamp(v), "rank": rank, "decoded_token": decode(t)})
        out.append(entry)
    return out


def usage(items: Sequence[Usage]) -> dict:
    """OpenAI usage of one or more requests (a batch of prompts sums them)."""
    prompt = sum(u.prompt_tokens for u in items)
    completion = sum(u.completion_tokens for u in items)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in items)}}
