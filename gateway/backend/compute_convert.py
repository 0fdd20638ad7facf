"""The gateway's core types <-> the compute service's messages: the one place the gateway's request
and answer meet ``pagedserve.compute.v1`` (the dispatcher's calls, the backend's Info).

Unset stays unset on the way out (``None`` -> an absent ``optional`` field or a proto3 zero), so the
compute service resolves it (``sampling_rules.resolve_sampling``, or the model's own defaults where
it has them). Only ``max_tokens`` is always sent, resolved by the gateway (``GenerationParams``; a
chat's may reach to the model's length); ``n``, though resolved there too, goes as the client gave
it (unset: the wire's zero, which means 1).
"""

from __future__ import annotations

from gateway.core.types import BackendRequest, Delta, ModelInfo, TokenLogprobs, Usage
from pagedserve.compute.v1 import compute_pb2

# Optional on the compute wire (presence means "set"): copied only when given.
_OPTIONAL = ("temperature", "top_p", "repetition_penalty", "seed", "logprobs", "prompt_logprobs")
# Plain on the compute wire (zero = the default): a None is sent as the zero.
_PLAIN = ("top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "n", "pooling")


def to_compute_request(request: BackendRequest, backend_request_id: str) -> compute_pb2.GenerateRequest:
    """The compute service's request (its id is the dispatcher's, one per attempt): the one place the
    validated sampling fields become protobuf."""
    o = request.options
    params = compute_pb2.SamplingParams(max_tokens=request.max_tokens, stop=o.stop, stop_token_ids=o.stop_token_ids,
                                        ignore_eos=o.ignore_eos)
    for name in (*_OPTIONAL, *_PLAIN):
        value = getattr(o, name)
        if value is not None:
            setattr(params, name, value)
    if o.logit_bias:
        params.logit_bias.update(o.logit_bias)
    c = o.constraint
    if c is not None:
        if c.kind == "json_object":
            params.json_object = True
        elif c.kind == "choice":
            params.choice.choices.extend(c.choices)
        else:
            setattr(params, c.kind, c.spec)
    return compute_pb2.GenerateRequest(request_id=backend_request_id, prompt_token_ids=request.prompt_token_ids,
                                       params=params, priority=request.priority, cache_salt=request.cache_salt,
                                       tenant=request.tenant)


def usage_from_pb(usage: compute_pb2.Usage) -> Usage:
    return Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens)


def delta_from_pb(message: compute_pb2.GenerateResponse) -> Delta:
    """One stream message of the compute service as a delta."""
    logprobs = logprobs_from_pb(message.logprobs)
    stop_string = message.stop_string if message.WhichOneof("matched_stop") == "stop_string" else ""
    usage = usage_from_pb(message.usage) if message.HasField("usage") else None
    # (A one-token prompt has nothing to score: its empty list reads as none, and the fronts show none.)
    prompt_logprobs = logprobs_from_pb(message.prompt_logprobs) if message.prompt_logprobs else None
    return Delta(message.index, message.text, list(message.token_ids), logprobs, message.finish_reason,
                 stop_string, usage, prompt_logprobs=prompt_logprobs,
                 embedding=list(message.embedding) if message.embedding else None)


def logprobs_from_pb(items) -> list[TokenLogprobs]:  # type: ignore[no-untyped-def]
    return [TokenLogprobs(lp.token_id, lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs), lp.rank)
            for lp in items]


def model_info_from_pb(info: compute_pb2.InfoResponse) -> ModelInfo:
    return ModelInfo(info.model_name, info.max_model_len, info.vocab_size, info.block_size, info.max_n,
                     info.max_logprobs, info.max_stop_strings, info.chat_template,
                     info.hidden_size)
