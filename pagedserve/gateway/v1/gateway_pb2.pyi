from pagedserve.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union
from pagedserve.common.v1.common_pb2 import ChoiceList as ChoiceList
from pagedserve.common.v1.common_pb2 import TokenLogprobs as TokenLogprobs
from pagedserve.common.v1.common_pb2 import Usage as Usage

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function_name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function_name: str
    def __init__(self, mode: _Optional[str] = ..., function_name: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "n", "ignore_eos", "min_tokens", "json_schema", "json_object", "regex", "choice", "grammar", "logit_bias", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    n: int
    ignore_eos: bool
    min_tokens: int
    json_schema: str
    json_object: bool
    regex: str
    choice: _common_pb2.ChoiceList
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[_common_pb2.ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "params", "priority", "request_id", "cache_salt", "tools", "tool_choice", "parallel_tool_calls")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    params: SamplingParams
    priority: int
    request_id: str
    cache_salt: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "stop_string", "tool_calls")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    stop_string: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "choices", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[Completion]
    usage: _common_pb2.Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "index", "text", "token_ids", "finish_reason", "usage", "logprobs", "stop_string", "tool_calls", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: _common_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    stop_string: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_model_len", "vocab_size", "block_size", "has_chat_template", "num_healthy_backends", "num_backends", "max_n", "max_logprobs", "max_stop_strings")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEALTHY_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    has_chat_template: bool
    num_healthy_backends: int
    num_backends: int
    max_n: int
    max_logprobs: int
    max_stop_strings: int
    def __init__(self, name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., num_healthy_backends: _Optional[int] = ..., num_backends: _Optional[int] = ..., max_n: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., max_stop_strings: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
