"""The public gRPC API's messages (``pagedserve.gateway.v1``) <-> the gateway core's types.

``request_from_pb`` reads the wire's encoding of "unset": proto3 zeros of ``max_tokens``,
``top_p``, ``repetition_penalty`` and ``n`` are unset, as are the absent ``optional`` fields
(``temperature``, ``seed``, ``logprobs``); every other zero is the value itself. The answers go back
as ``reply_to_pb`` (a unary reply) and ``piece_to_pb`` (one stream message).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.tools import MAX_TOOLS
from gateway.core.types import (ChatMessage, Constraint, Delta, GenerateRequest, Reply, SamplingOptions,
                                TokenLogprobs, Tool, ToolCall, Usage)
from gateway.core.validate import check_message_count
from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument, echo
from pagedserve.gateway.v1 import gateway_pb2

_ZERO_IS_UNSET = ("max_tokens", "top_p", "repetition_penalty", "n")
_OPTIONAL = ("temperature", "seed", "logprobs", "prompt_logprobs")
_PLAIN = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos")


def constraint_from_pb(p: gateway_pb2.SamplingParams) -> Constraint | None:
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not p.json_object:
            raise InvalidArgument("params.json_object must be true when set (leave the constraint unset for free text)")
        return Constraint("json_object")
    if kind == "choice":
        return Constraint("choice", choices=tuple(p.choice.choices))
    return Constraint(kind, getattr(p, kind))


def options_from_pb(p: gateway_pb2.SamplingParams) -> SamplingOptions:
    """The sampling fields; a negative max_tokens stays itself (named as the client sent it)."""
    values: dict = {name: getattr(p, name) or None for name in _ZERO_IS_UNSET}
    values.update((name, getattr(p, name)) for name in _PLAIN)
    values.update((name, getattr(p, name)) for name in _OPTIONAL if p.HasField(name))
    if len(p.logit_bias) > rules.MAX_LOGIT_BIAS_ENTRIES:
        rules.check_logit_bias(p.logit_bias)  # names the count before the map is copied
    # The repeated fields are referenced, not copied: validation counts them before reading any.
    return SamplingOptions(stop=p.stop, stop_token_ids=p.stop_token_ids,  # type: ignore[arg-type]
                           constraint=constraint_from_pb(p), logit_bias=dict(p.logit_bias) or None, **values)


def messages_from_pb(messages: Sequence[gateway_pb2.ChatMessage], max_messages: int) -> list[ChatMessage] | None:
    """The chat messages, counted before any is copied (4 MiB of empty messages are two million)."""
    check_message_count(len(messages), max_messages)
    return [ChatMessage(m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                        m.tool_call_id) for m in messages] if messages else None


def request_from_pb(request: gateway_pb2.GenerateRequest, max_messages: int) -> GenerateRequest:
    if len(request.tools) > MAX_TOOLS:  # counted before any is copied
        raise InvalidArgument(f"tools: at most {MAX_TOOLS} tools, got {len(request.tools)}")
    choice = request.tool_choice
    mode = choice.mode or ("function" if choice.function_name else "")
    if choice.function_name and mode != "function":
        raise InvalidArgument(f"tool_choice.function_name is for mode 'function', not {echo(mode)}")
    return GenerateRequest(prompt=request.prompt or None, messages=messages_from_pb(request.messages, max_messages),
                           options=options_from_pb(request.params), priority=request.priority,
                           request_id=request.request_id, cache_salt=request.cache_salt,
                           tools=[Tool(t.name, t.description, t.parameters) for t in request.tools] or None,
                           tool_choice=mode or None, tool_function=choice.function_name,
                           parallel_tool_calls=request.parallel_tool_calls
                           if request.HasField("parallel_tool_calls") else None)


def tokenize_from_pb(request: gateway_pb2.TokenizeRequest, max_messages: int) -> GenerateRequest:
    return GenerateRequest(prompt=request.prompt or None, messages=messages_from_pb(request.messages, max_messages))


def usage_to_pb(usage: Usage) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                             cached_prompt_tokens=usage.cached_prompt_tokens)


def logprobs_to_pb(items: list[TokenLogprobs]) -> list[gateway_pb2.TokenLogprobs]:
    return [gateway_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                                      top_logprobs=lp.top_logprobs, rank=lp.rank) for lp in items]


def tool_calls_to_pb(calls: list[ToolCall]) -> list[gateway_pb2.ToolCall]:
    return [gateway_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def reply_to_pb(reply: Reply) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        request_id=reply.request_id, usage=usage_to_pb(reply.usage),
        choices=[gateway_pb2.Completion(index=c.index, text=c.text, token_ids=c.token_ids,
                                        finish_reason=c.finish_reason, logprobs=logprobs_to_pb(c.logprobs),
                                        stop_string=c.stop_string, tool_calls=tool_calls_to_pb(c.tool_calls))
                 for c in reply.choices],
        prompt_logprobs=logprobs_to_pb(reply.prompt_logprobs or []))


def piece_to_pb(request_id: str, piece: Delta) -> gateway_pb2.GenerateStreamResponse:
    message = gateway_pb2.GenerateStreamResponse(
        request_id=request_id, index=piece.index, text=piece.text, token_ids=piece.token_ids,
        finish_reason=piece.finish_reason, logprobs=logprobs_to_pb(piece.logprobs), stop_string=piece.stop_string,
        tool_calls=tool_calls_to_pb(piece.tool_calls), prompt_logprobs=logprobs_to_pb(piece.prompt_logprobs or []))
    if piece.usage is not None:
        message.usage.CopyFrom(usage_to_pb(piece.usage))
    return message
