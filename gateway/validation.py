"""Checks a public request before any backend work and converts it to the compute service's request.

Everything that can be checked here is: a bad request costs the backends nothing, and the error
names the field (``InvalidArgument``, mapped to INVALID_ARGUMENT by the server's interceptor). The
rules themselves are ``pagedserve.sampling_rules``, the very functions the compute service checks
its requests with; the limits are the ones the backend reports in ``Info`` (the shared defaults
where it reports none). Public zeros mean "unset" and are resolved to the defaults first, so the
checks see what the engine would run.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import GatewayConfig
from pagedserve import sampling_rules as rules
from pagedserve.compute.v1 import compute_pb2
from pagedserve.errors import InvalidArgument
from pagedserve.gateway.v1 import gateway_pb2


@dataclass(frozen=True)
class PromptInput:
    """What to tokenize: a plain prompt, or chat messages (exactly one is set)."""

    prompt: str | None
    messages: list[dict[str, str]] | None


def limits_of(info: compute_pb2.InfoResponse) -> rules.RequestLimits:
    """The backend's reported limits; the shared defaults for those it does not report."""
    default = rules.DEFAULT_LIMITS
    return rules.RequestLimits(max_n=info.max_n or default.max_n,
                               max_logprobs=info.max_logprobs or default.max_logprobs,
                               max_stop_strings=info.max_stop_strings or default.max_stop_strings)


def check_prompt_input(request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest,
                       config: GatewayConfig) -> PromptInput:
    """Exactly one of prompt or messages, within the size limits (counts first), roles known."""
    if bool(request.prompt) == bool(request.messages):
        raise InvalidArgument("prompt, messages: give exactly one of them")
    if request.messages:
        if len(request.messages) > config.max_messages:  # before anything is copied
            raise InvalidArgument(f"messages: at most {config.max_messages} messages, got {len(request.messages)}")
        pairs = [(m.role, m.content) for m in request.messages]
        rules.check_messages(pairs, max_messages=config.max_messages, max_chars=config.max_prompt_chars)
        return PromptInput(None, [{"role": role, "content": content} for role, content in pairs])
    rules.check_prompt_chars(request.prompt, config.max_prompt_chars)
    return PromptInput(request.prompt, None)


def resolved_params(p: gateway_pb2.SamplingParams) -> dict[str, object]:
    """The public sampling fields with their defaults applied (a public zero means "unset")."""
    default = rules.DEFAULT_MAX_TOKENS
    return {
        "max_tokens": p.max_tokens or default, "temperature": p.temperature if p.HasField("temperature") else 1.0,
        "top_p": p.top_p or 1.0, "top_k": p.top_k, "min_p": p.min_p, "seed": p.seed if p.HasField("seed") else None,
        "stop": p.stop, "stop_token_ids": p.stop_token_ids, "min_tokens": p.min_tokens,
        "repetition_penalty": p.repetition_penalty or 1.0, "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty, "n": p.n or 1,
        "logprobs": p.logprobs if p.HasField("logprobs") else None,
    }


def check_request(request: gateway_pb2.GenerateRequest, info: compute_pb2.InfoResponse) -> None:
    """Every field of the request besides the prompt, against the model's limits."""
    rules.check_ids(request.request_id, request.cache_salt)
    if request.params.max_tokens < 0:  # 0 is "unset"; a negative one is named as the client sent it
        raise InvalidArgument(f"params.max_tokens must be >= 0, got {request.params.max_tokens}")
    rules.check_sampling(resolved_params(request.params), limits=limits_of(info), vocab_size=info.vocab_size or None)
    check_constraint(request.params)


def check_unary_reply(request: gateway_pb2.GenerateRequest, max_bytes: int) -> None:
    """A unary Generate whose reply cannot fit the send limit is refused before any work."""
    p = resolved_params(request.params)
    rules.check_reply_fits(p["n"], p["max_tokens"], p["logprobs"], max_bytes)


def check_prompt_token_ids(token_ids: list[int], request: gateway_pb2.GenerateRequest,
                           info: compute_pb2.InfoResponse) -> list[int]:
    """A prompt given as token ids (instead of prompt or messages): each id in the vocabulary."""
    if request.prompt or request.messages:
        raise InvalidArgument("prompt, messages: give exactly one of them")
    rules.check_token_ids("prompt", token_ids, info.vocab_size or None)
    return list(token_ids)


def check_constraint(p: gateway_pb2.SamplingParams) -> None:
    """The constraint's kind and sizes only: the compute service compiles it (and says whether the
    schema, regex or grammar is valid)."""
    kind = p.WhichOneof("constraint")
    if kind is None:
        return
    if kind == "json_object" and not p.json_object:
        raise InvalidArgument("params.json_object must be true when set (leave the constraint unset for free text)")
    rules.check_constrained_sampling(kind, ignore_eos=p.ignore_eos, min_tokens=p.min_tokens)
    spec = getattr(p, kind) if kind in ("json_schema", "regex", "grammar") else ""
    rules.check_constraint(kind, spec, p.choice.choices if kind == "choice" else ())


def check_length(num_prompt_tokens: int, request: gateway_pb2.GenerateRequest, info: compute_pb2.InfoResponse) -> None:
    """The tokenized prompt is non-empty and, with max_tokens, fits the model."""
    field = "messages" if request.messages else "prompt"
    if num_prompt_tokens == 0:
        raise InvalidArgument(f"{field}: tokenizes to no tokens")
    max_model_len = info.max_model_len or rules.MAX_PROMPT_TOKENS
    rules.check_prompt_length(num_prompt_tokens, request.params.max_tokens or rules.DEFAULT_MAX_TOKENS,
                              max_model_len, field=field)


def to_compute_request(request: gateway_pb2.GenerateRequest, prompt_token_ids: list[int],
                       backend_request_id: str) -> compute_pb2.GenerateRequest:
    """The compute service's request; public zeros become "unset" so the model's defaults apply."""
    p = request.params
    params = compute_pb2.SamplingParams(
        max_tokens=p.max_tokens or rules.DEFAULT_MAX_TOKENS,
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
    kind = p.WhichOneof("constraint")
    if kind == "choice":
        params.choice.choices.extend(p.choice.choices)
    elif kind is not None:
        setattr(params, kind, getattr(p, kind))
    return compute_pb2.GenerateRequest(
        request_id=backend_request_id,
        prompt_token_ids=prompt_token_ids,
        params=params,
        priority=request.priority,
        cache_salt=request.cache_salt,
    )
