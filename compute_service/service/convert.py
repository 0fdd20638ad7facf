"""Protobuf <-> core types at the service's edge: the engine never sees a protobuf message.

Unset fields (absent ``optional`` ones, a zero ``n``) take the defaults of
``sampling_rules.resolve_sampling``, the one place that says them (proto3 zeros are not the
defaults: temperature 1.0, top_p 1.0); validation errors name the field as the wire spells it.
"""

from __future__ import annotations

from pagedserve import sampling_rules as rules
from pagedserve.compute.v1 import compute_pb2 as pb
from pagedserve.errors import InvalidArgument

from memory_service.api import KvTierInfo

from compute_service.model.model_info import ModelInfo
from compute_service.engine.outputs import CompletionDelta, RequestDelta
from compute_service.engine.request import EngineLoad, GenerateInput
from compute_service.engine.sampler import TokenLogprobs
from compute_service.engine.sampling_params import SamplingParams
from compute_service.structured.constraint import Constraint

# Fields copied as they are (proto3 zero = the core default, or "unset" marked by presence).
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs", "prompt_logprobs")
_PLAIN_FIELDS = ("top_k", "min_p", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty")


def constraint_from_pb(msg: pb.SamplingParams) -> Constraint | None:
    """The ``constraint`` oneof as a Constraint (sizes checked; validity is the compiler's verdict)."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidArgument("json_object must be true when set (leave the constraint unset for free text)")
        return Constraint("json_object")
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.choices))
    return Constraint(kind, getattr(msg, kind))


def constraint_to_pb(constraint: Constraint, msg: pb.SamplingParams) -> None:
    """Set ``msg``'s constraint oneof from ``constraint``."""
    if constraint.kind == "json_object":
        msg.json_object = True
    elif constraint.kind == "choice":
        msg.choice.choices.extend(constraint.choices)
    else:
        setattr(msg, constraint.kind, constraint.spec)


def params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire; raises InvalidArgument naming the bad field (``params.<name>``)."""
    rules.check_counts(len(msg.stop), len(msg.stop_token_ids))  # before the repeated fields are copied
    given: dict = {name: getattr(msg, name) for name in _PLAIN_FIELDS}
    given.update({name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)})
    given["n"] = msg.n or None  # a zero n is unset on this wire
    given["pooling"] = msg.pooling or None  # empty: generate
    given["stop"] = tuple(msg.stop)
    given["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.logit_bias:
        rules.check_logit_bias(msg.logit_bias)  # the count before the map is copied
        given["logit_bias"] = dict(msg.logit_bias)
    try:
        return SamplingParams(**rules.resolve_sampling(given), constraint=constraint_from_pb(msg))
    except InvalidArgument as exc:
        raise InvalidArgument(f"params.{exc}") from None


def params_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        stop=params.stop, n=params.n,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    msg.pooling = params.pooling or ""
    if params.constraint is not None:
        constraint_to_pb(params.constraint, msg)
    msg.logit_bias.update(dict(params.logit_bias))
    return msg


def generate_from_pb(msg: pb.GenerateRequest, default_request_id: str, max_model_len: int) -> GenerateInput:
    """The request in core types (model-dependent checks are the engine's ``check_request``).

    Sizes come first: the prompt's length is checked against the model before its ids are copied
    or read one by one (a prompt far beyond the model costs a length comparison, nothing more).
    """
    params = params_from_pb(msg.params)  # copies only bounded fields (their counts checked first)
    rules.check_prompt_length(len(msg.prompt_token_ids), params.max_tokens, max_model_len)
    return GenerateInput(
        request_id=msg.request_id or default_request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        params=params,
        priority=msg.priority,
        cache_salt=msg.cache_salt,
        tenant=msg.tenant,
    )


def _logprobs_to_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                            top_logprobs=lp.top_logprobs, rank=lp.rank)


def completion_to_pb(request_id: str, c: CompletionDelta) -> pb.GenerateResponse:
    """One stream message: what completion ``c`` produced since its previous message."""
    msg = pb.GenerateResponse(
        request_id=request_id, index=c.index, token_ids=c.token_ids, text=c.text,
        logprobs=[_logprobs_to_pb(lp) for lp in c.logprobs or ()], finish_reason=c.finish_reason or "",
    )
    if isinstance(c.stop_reason, str):
        msg.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        msg.stop_token_id = c.stop_reason
    return msg


def responses_to_pb(out: RequestDelta) -> list[pb.GenerateResponse]:
    """The stream messages for one step's news; the request's last one carries usage."""
    messages = [completion_to_pb(out.request_id, c) for c in out.completions]
    if out.prompt_logprobs is not None:  # once, with the first news after the prompt was computed
        if not messages:
            messages.append(pb.GenerateResponse(request_id=out.request_id))
        messages[0].prompt_logprobs.extend(_logprobs_to_pb(lp) for lp in out.prompt_logprobs)
    if out.embedding is not None:  # once, when the request finishes
        if not messages:
            messages.append(pb.GenerateResponse(request_id=out.request_id))
        messages[0].embedding.extend(out.embedding)
    if out.finished:
        if not messages:  # nothing new in the last step (cannot happen today; keep usage anyway)
            messages.append(pb.GenerateResponse(request_id=out.request_id))
        messages[-1].usage.CopyFrom(pb.Usage(
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=out.num_completion_tokens,
            cached_prompt_tokens=out.num_cached_tokens,
        ))
    return messages


def load_to_pb(load: EngineLoad, max_queued_requests: int, memory_service_id: str = "",
               memory_service_epoch: str = "") -> pb.LoadResponse:
    return pb.LoadResponse(
        num_running=load.num_running, num_waiting=load.num_waiting, kv_usage=load.kv_usage,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate, num_pending_tokens=load.num_pending_tokens,
        max_queued_requests=max_queued_requests, memory_service_id=memory_service_id,
        memory_service_epoch=memory_service_epoch,
    )


def info_to_pb(info: ModelInfo, *, block_size: int, num_kv_blocks: int, memory_service_id: str = "",
               memory_service_epoch: str = "", kv_tiers: tuple[KvTierInfo, ...] = (),
               bytes_per_block: int = 1) -> pb.InfoResponse:
    """Args: ``bytes_per_block`` of the model's KV layout, to state the tiers' capacities in blocks."""
    return pb.InfoResponse(
        model_name=info.model_name, max_model_len=info.max_model_len, block_size=block_size, dtype=info.dtype,
        device=info.device, vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
        bos_token_id=info.bos_token_id, pad_token_id=info.pad_token_id, chat_template=info.chat_template,
        tokenizer_files=[pb.TokenizerFile(name=f.name, size=len(f.data), sha256=f.sha256)
                         for f in info.tokenizer_files],
        max_n=rules.MAX_N, max_logprobs=rules.MAX_LOGPROBS, max_stop_strings=rules.MAX_STOP_STRINGS,
        default_params=params_to_pb(SamplingParams()), num_kv_blocks=num_kv_blocks,
        memory_service_id=memory_service_id, memory_service_epoch=memory_service_epoch,
        kv_tiers=[pb.KvTier(kind=t.kind, capacity_bytes=t.capacity_bytes,
                            capacity_blocks=t.capacity_bytes // bytes_per_block) for t in kv_tiers],
        kernels=info.kernels, hidden_size=info.hidden_size, kernel_paths=dict(info.kernel_paths),
    )
