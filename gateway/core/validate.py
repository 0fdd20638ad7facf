"""One check of a request, before any backend work: ``validate(request) -> ValidatedRequest``.

Everything that can be checked before tokenizing is checked here, once, for every front: a bad
request costs the backends nothing, and the error names the field as the public gRPC API spells
it (``params.top_p ...``; the HTTP front maps that name to its own parameter). The rules are
``pagedserve.sampling_rules``, the very functions the compute service checks its requests with; the
limits are the ones the backend reports in ``Info`` (the shared defaults where it reports none).
Unset fields are resolved to their defaults first (``sampling_rules.resolve_sampling``), so the
checks see what the engine would run; but what validation returns, ``GenerationParams``, keeps them
unset (None) except ``max_tokens`` and ``n``, whose defaults are the gateway's own: the compute
service resolves the rest, from the model's own defaults where it has them. The rest of the gateway
reads those typed fields and never the client's raw ones again.

The one rule that needs the tokens, the prompt's length against the model, is
``ValidatedRequest.to_backend``'s, right after tokenizing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from gateway.core.streaming import ReplyBudget
from gateway.core.types import BackendRequest, GenerateRequest, GenerationParams, ModelInfo
from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument, echo

_INT32 = 1 << 31


@dataclass(frozen=True)
class PromptLimits:
    """The gateway's own bounds on what it tokenizes (its config's)."""

    max_prompt_chars: int = rules.MAX_PROMPT_CHARS
    max_messages: int = rules.MAX_MESSAGES


@dataclass(frozen=True)
class ValidatedRequest:
    """A request every field of which was checked.

    Attributes:
        request: as the front converted it.
        sampling: its sampling fields, typed, unset ones still unset: what the gateway reads and sends.
        info: the model's limits it was checked against.
        params: every sampling field with its default applied, as the rules checked them (what the
            engine will run); only a view: nothing is sent from it.
    """

    request: GenerateRequest
    sampling: GenerationParams
    info: ModelInfo
    params: Mapping[str, object]

    @property
    def prompt_field(self) -> str:
        return "messages" if self.request.messages else "prompt"

    def to_backend(self, token_ids: list[int], cache_salt: str, max_tokens_to_context: bool = False,
                   tenant: str = "") -> BackendRequest:
        """The backend's request for the tokenized prompt, once it fits the model with max_tokens.

        Args:
            token_ids: the prompt's tokens.
            cache_salt: the prefix-cache namespace (the tenant's, see ``Tenant.cache_salt``).
            max_tokens_to_context: without a client's max_tokens, generate up to the model's length
                (OpenAI's chat default) instead of the API's default.
            tenant: who sent it (the compute service's fair admission is per tenant).
        Raises:
            InvalidArgument: no tokens, or the prompt plus max_tokens exceed the model.
        """
        s = self.sampling
        max_tokens = s.max_tokens
        max_model_len = self.info.max_model_len
        if max_tokens_to_context and not s.is_max_tokens_given and max_model_len:
            max_tokens = max(max_model_len - len(token_ids), 1)
        if not token_ids:
            raise InvalidArgument(f"{self.prompt_field}: tokenizes to no tokens")
        rules.check_prompt_length(len(token_ids), max_tokens, max_model_len or rules.MAX_PROMPT_TOKENS,
                                  field=self.prompt_field)
        r = self.request
        return BackendRequest(token_ids, s.options, max_tokens, r.priority, cache_salt, tenant, s.n)


def limits_of(info: ModelInfo) -> rules.RequestLimits:
    """The backend's reported limits; the shared defaults for those it does not report."""
    default = rules.DEFAULT_LIMITS
    return rules.RequestLimits(max_n=info.max_n or default.max_n,
                               max_logprobs=info.max_logprobs or default.max_logprobs,
                               max_stop_strings=info.max_stop_strings or default.max_stop_strings)


def _check_int32(name: str, value: int) -> None:
    """A field the compute service's wire carries as int32 (beyond it the conversion would fail)."""
    if not -_INT32 <= value < _INT32:
        raise InvalidArgument(f"{name} must be a 32-bit integer, got {echo(value)}")


def validate(request: GenerateRequest, info: ModelInfo, limits: PromptLimits = PromptLimits(),
             reply: ReplyBudget | None = None, num_prompts: int = 1) -> ValidatedRequest:
    """Every rule of the request besides its tokenized length, cheap ones first.

    Args:
        request: the request as a front converted it.
        info: the model's limits.
        limits: the gateway's prompt bounds.
        reply: for a unary answer, the bytes it may carry (a reply that cannot fit is refused
            before any work); None for a stream.
        num_prompts: prompts sharing that reply (the HTTP API's prompt lists).
    Raises:
        InvalidArgument: naming the first bad field.
    """
    rules.check_ids(request.request_id, request.cache_salt)
    _check_int32("priority", request.priority)
    o = request.options
    params = rules.resolve_sampling(vars(o))  # no element copied: check_sampling checks counts first
    rules.check_sampling(params, limits=limits_of(info), vocab_size=info.vocab_size or None)
    # Resolved once, here: the two defaults that are the gateway's (GenerationParams says why).
    sampling = GenerationParams(o, max_tokens=cast(int, params["max_tokens"]), n=cast(int, params["n"]))
    if o.top_k is not None:
        _check_int32("params.top_k", o.top_k)
    if o.stop_token_ids and not info.vocab_size:
        _check_int32("params.stop_token_ids", max(o.stop_token_ids))
    if o.logit_bias and not info.vocab_size:
        _check_int32("params.logit_bias", max(o.logit_bias))
    if o.constraint is not None:
        c = o.constraint
        rules.check_constrained_sampling(c.kind, ignore_eos=o.ignore_eos, min_tokens=o.min_tokens or 0,
                                         pooling=o.pooling)
        rules.check_constraint(c.kind, c.spec, c.choices)
    if reply is not None:
        rules.check_reply_fits(sampling.n * num_prompts, sampling.max_tokens, o.logprobs, reply.max_bytes, reply.hint)
    check_prompt(request, info, limits)
    return ValidatedRequest(request, sampling, info, params)


def check_prompt(request: GenerateRequest, info: ModelInfo, limits: PromptLimits) -> None:
    """Exactly one of prompt, messages or token ids, within the size limits (counts first)."""
    given = [name for name, value in (("prompt", request.prompt), ("messages", request.messages),
                                      ("prompt_token_ids", request.prompt_token_ids)) if value]
    if request.prompt_token_ids is not None and not request.prompt and not request.messages:
        rules.check_token_ids("prompt", request.prompt_token_ids, info.vocab_size or None)
        if not info.vocab_size and request.prompt_token_ids:
            _check_int32("prompt", max(request.prompt_token_ids))
        return
    if len(given) != 1:
        raise InvalidArgument("prompt, messages: give exactly one of them")
    if request.messages:
        check_message_count(len(request.messages), limits.max_messages)
        rules.check_messages([(m.role, m.content) for m in request.messages], max_messages=limits.max_messages,
                             max_chars=limits.max_prompt_chars)
    else:
        rules.check_prompt_chars(request.prompt or "", limits.max_prompt_chars)


# A prompt averaging more characters a token than this is refused as too long for the model's
# context before it is rendered or tokenized: English runs at ~4, JSON schemas ~3.
MAX_CHARS_PER_TOKEN = 16


def check_prompt_size(request: GenerateRequest, info: ModelInfo, limits: PromptLimits) -> None:
    """Before anything of a prompt is parsed, rendered or tokenized: its characters, a chat's messages,
    earlier tool calls and tools all counted, within ``max_prompt_chars`` and within
    ``MAX_CHARS_PER_TOKEN`` per token of the model's context.

    Why tools count: they are rendered into the prompt. 128 tools of 220 properties each (3.8 MB)
    passed the messages' character cap and took 21.9 s to tokenize into 1.48M tokens, a 400 only
    after that, the gateway stalled meanwhile.
    """
    num_chars = len(request.prompt or "")
    for m in request.messages or ():
        num_chars += len(m.content) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
    num_chars += sum(len(t.name) + len(t.description) + len(t.parameters) for t in request.tools or ())
    limit = limits.max_prompt_chars
    if info.max_model_len:
        limit = min(limit, info.max_model_len * MAX_CHARS_PER_TOKEN)
    if num_chars > limit:
        fields = "prompt" if request.prompt else "messages, tools" if request.tools else "messages"
        raise InvalidArgument(f"{fields}: at most {limit} characters in all for this model (its context is "
                              f"{info.max_model_len or 'unknown'} tokens; tools count), got {num_chars}")


def check_message_count(num_messages: int, max_messages: int) -> None:
    """At most ``max_messages`` chat messages: an edge calls it before copying any."""
    if num_messages > max_messages:
        raise InvalidArgument(f"messages: at most {max_messages} messages, got {num_messages}")
