"""The gateway's own model of a request and its answer: plain dataclasses, no protobuf.

Both fronts convert to and from these at their edge (``gateway.grpc.convert`` for the public gRPC
API, ``gateway.openai_api.convert`` for the HTTP API), and the dispatcher converts them to the
compute service's messages at the one place it calls a backend (``gateway.backend.compute_convert``).

Unset is ``None``, never a zero: the public gRPC wire reads a zero ``max_tokens``, ``top_p``,
``repetition_penalty`` or ``n`` as "unset" and its edge says so; the HTTP edge passes what the
client wrote, so ``n: 0`` there is a value, and a bad one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint: ``kind`` one of ``sampling_rules.CONSTRAINT_KINDS``; ``spec`` the
    schema, regex or grammar text ("" for json_object and choice); ``choices`` a choice's alternatives."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplingOptions:
    """The public sampling fields as the client gave them (None: unset, the default applies).

    Frozen: an edge builds them once and they travel as they are, through ``validate`` into
    ``GenerationParams`` and on to the compute service's message (``stop`` and ``stop_token_ids`` may
    be the gRPC wire's repeated fields themselves, referenced rather than copied).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    n: int | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    constraint: Constraint | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    # The prompt's tokens scored, with this many alternatives each (the request reads no cached prefix).
    prompt_logprobs: int | None = None
    # An embedding request (max_tokens 0): "last" or "mean" pooling of the final hidden states.
    pooling: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``parameters`` is the JSON text of its arguments' schema
    ("" = no parameters)."""

    name: str
    description: str = ""
    parameters: str = ""


@dataclass(frozen=True)
class ChatMessage:
    """One turn: an assistant's may carry the calls it made, a tool's names the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass
class GenerateRequest:
    """One generation request: exactly one of ``prompt``, ``messages`` or ``prompt_token_ids``.

    ``prompt_token_ids`` is for an in-process front (the HTTP API's token-id prompts); the public
    gRPC API gives text or messages.
    """

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    options: SamplingOptions = field(default_factory=SamplingOptions)
    priority: int = 0
    request_id: str = ""
    cache_salt: str = ""
    # Tool calling (chats only; ``gateway.core.tools``): the functions, and "none", "auto",
    # "required" or "function" (then ``tool_function`` names it); None: "auto" with tools, else "none".
    tools: list[Tool] | None = None
    tool_choice: str | None = None
    tool_function: str = ""
    parallel_tool_calls: bool | None = None  # None: True


@dataclass(frozen=True)
class GenerationParams:
    """A request's sampling fields once ``validate`` checked them: what the gateway reads from then
    on, and what travels to the compute service (``BackendRequest``), converted to its message once
    (``gateway.backend.compute_convert``).

    Two kinds of field, on purpose. ``options`` are the client's fields as given, the unset ones
    None: the compute service resolves those (a model's generation_config.json may set temperature,
    top_p or repetition_penalty), so the gateway must not fill in a default it cannot know, and
    they reach the compute service unset. ``max_tokens`` and ``n`` are resolved here, once: their
    defaults are the API's own (``sampling_rules.SAMPLING_DEFAULTS``, model-independent), and the
    gateway budgets with them itself (a unary reply's size, a backend's load, time per token).

    Attributes:
        options: the client's fields; read ``max_tokens`` and ``n`` below rather than theirs.
        max_tokens: the client's, else the API's default (a chat's may still grow to the model's
            length once the prompt is tokenized: ``ValidatedRequest.to_backend``).
        n: completions of the prompt, the client's else 1.
    """

    options: SamplingOptions
    max_tokens: int
    n: int

    @property
    def is_max_tokens_given(self) -> bool:
        return self.options.max_tokens is not None

    @property
    def is_scoring(self) -> bool:
        """The prompt's tokens are scored (``prompt_logprobs``): the first delta carries their scores."""
        return self.options.prompt_logprobs is not None


@dataclass(frozen=True)
class BackendRequest:
    """What the dispatcher sends a compute service: the tokenized, validated request.

    ``options``, ``max_tokens`` and ``n`` are its ``GenerationParams``' (the client's unset fields
    still unset; ``max_tokens`` and ``n`` resolved, a chat's max_tokens perhaps grown to the context).
    """

    prompt_token_ids: list[int]
    options: SamplingOptions
    max_tokens: int
    priority: int
    cache_salt: str
    tenant: str = ""  # the tenant's name: the compute service admits fairly between tenants
    n: int = 1


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and, when asked for, the most likely alternatives."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0  # 1 + the tokens more likely than token_id (prompt logprobs; 0 = not given)


@dataclass
class Delta:
    """What one completion (``index``) produced since its previous delta; the request's last delta
    carries ``usage``. ``stop_string`` is set when a stop string ended the completion."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    stop_string: str = ""
    usage: Usage | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # with finish_reason "tool_calls"
    # Once per request, with options.prompt_logprobs: prompt tokens 1..L-1 scored, and the prompt's
    # L token ids (the core adds them: the backend's answer names each scored token, not the first).
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_token_ids: list[int] | None = None
    embedding: list[float] | None = None  # options.pooling: the prompt's, unit norm, once


@dataclass
class Completion:
    """One whole completion of a unary reply."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    stop_string: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Reply:
    """A whole answer: one completion per index, in index order."""

    request_id: str
    choices: list[Completion]
    usage: Usage
    prompt_logprobs: list[TokenLogprobs] | None = None  # as Delta's
    prompt_token_ids: list[int] | None = None
    embedding: list[float] | None = None  # as Delta's


@dataclass(frozen=True)
class ModelInfo:
    """What a backend says about its model (its ``Info``), as the gateway's checks need it.

    Zero limits mean "not reported" (an older backend): the shared defaults apply.
    """

    model_name: str
    max_model_len: int = 0
    vocab_size: int = 0
    block_size: int = 0
    max_n: int = 0
    max_logprobs: int = 0
    max_stop_strings: int = 0
    chat_template: str = ""
    hidden_size: int = 0  # an embedding's length
