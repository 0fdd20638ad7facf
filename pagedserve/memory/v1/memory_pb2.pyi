from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_name", "layout", "model_fingerprint")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    layout: KvLayout
    model_fingerprint: str
    def __init__(self, client_name: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("shape", "dtype", "device", "shm_name", "cuda_ipc", "num_bytes")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    shm_name: str
    cuda_ipc: CudaIpcHandle
    num_bytes: int
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., shm_name: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_index", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_index: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("client_id", "pool", "num_blocks", "block_size", "lease_ttl_s", "num_reserved_blocks", "reserved_min_priority", "memory_service_id", "tiers", "memory_service_epoch")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_MIN_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SERVICE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    pool: PoolDescriptor
    num_blocks: int
    block_size: int
    lease_ttl_s: float
    num_reserved_blocks: int
    reserved_min_priority: int
    memory_service_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[KvTier]
    memory_service_epoch: str
    def __init__(self, client_id: _Optional[str] = ..., pool: _Optional[_Union[PoolDescriptor, _Mapping]] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., num_reserved_blocks: _Optional[int] = ..., reserved_min_priority: _Optional[int] = ..., memory_service_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[KvTier, _Mapping]]] = ..., memory_service_epoch: _Optional[str] = ...) -> None: ...

class KvTier(_message.Message):
    __slots__ = ("kind", "capacity_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    capacity_bytes: int
    def __init__(self, kind: _Optional[str] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("num_freed_sequences",)
    NUM_FREED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    num_freed_sequences: int
    def __init__(self, num_freed_sequences: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("client_id", "interval_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    interval_s: float
    def __init__(self, client_id: _Optional[str] = ..., interval_s: _Optional[float] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("server_time",)
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    server_time: float
    def __init__(self, server_time: _Optional[float] = ...) -> None: ...

class AllocateOp(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "max_num_new_tokens", "priority", "namespace", "skip_cache_read")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SKIP_CACHE_READ_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_num_new_tokens: int
    priority: int
    namespace: str
    skip_cache_read: bool
    def __init__(self, seq_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_num_new_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., namespace: _Optional[str] = ..., skip_cache_read: _Optional[bool] = ...) -> None: ...

class AppendOp(_message.Message):
    __slots__ = ("seq_id", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeOp(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class ForkOp(_message.Message):
    __slots__ = ("parent_seq_id", "child_seq_id")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: str
    child_seq_id: str
    def __init__(self, parent_seq_id: _Optional[str] = ..., child_seq_id: _Optional[str] = ...) -> None: ...

class SequenceOp(_message.Message):
    __slots__ = ("allocate", "append", "free", "fork")
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    allocate: AllocateOp
    append: AppendOp
    free: FreeOp
    fork: ForkOp
    def __init__(self, allocate: _Optional[_Union[AllocateOp, _Mapping]] = ..., append: _Optional[_Union[AppendOp, _Mapping]] = ..., free: _Optional[_Union[FreeOp, _Mapping]] = ..., fork: _Optional[_Union[ForkOp, _Mapping]] = ...) -> None: ...

class AppendBatch(_message.Message):
    __slots__ = ("seq_ids", "num_tokens", "token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("client_id", "ops", "appends", "late_ops", "prefill_tokens_per_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    LATE_OPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    ops: _containers.RepeatedCompositeFieldContainer[SequenceOp]
    appends: AppendBatch
    late_ops: _containers.RepeatedCompositeFieldContainer[SequenceOp]
    prefill_tokens_per_s: float
    def __init__(self, client_id: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[SequenceOp, _Mapping]]] = ..., appends: _Optional[_Union[AppendBatch, _Mapping]] = ..., late_ops: _Optional[_Iterable[_Union[SequenceOp, _Mapping]]] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst", "seq_index")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    seq_index: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ..., seq_index: _Optional[int] = ...) -> None: ...

class OpResult(_message.Message):
    __slots__ = ("ok", "block_ids", "num_cached_tokens", "num_new_tokens", "copies", "loading")
    OK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    num_new_tokens: int
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    loading: bool
    def __init__(self, ok: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., loading: _Optional[bool] = ...) -> None: ...

class AppendBatchResult(_message.Message):
    __slots__ = ("ok", "num_new_blocks", "new_block_ids", "copies")
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[bool]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, ok: _Optional[_Iterable[bool]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "append_results", "num_available_blocks", "num_available_reserved_blocks", "loaded_seq_ids")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    APPEND_RESULTS_FIELD_NUMBER: _ClassVar[int]
    NUM_AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_AVAILABLE_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[OpResult]
    append_results: AppendBatchResult
    num_available_blocks: int
    num_available_reserved_blocks: int
    loaded_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, results: _Optional[_Iterable[_Union[OpResult, _Mapping]]] = ..., append_results: _Optional[_Union[AppendBatchResult, _Mapping]] = ..., num_available_blocks: _Optional[int] = ..., num_available_reserved_blocks: _Optional[int] = ..., loaded_seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("client_id", "seq_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    seq_id: str
    def __init__(self, client_id: _Optional[str] = ..., seq_id: _Optional[str] = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("name", "num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    def __init__(self, name: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pools", "kv_utilization", "fragmentation", "prefix_cache_queries", "prefix_cache_hits", "num_evictions", "num_copy_on_writes", "num_sequences", "num_clients", "block_size", "tiers")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    KV_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPY_ON_WRITES_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    kv_utilization: float
    fragmentation: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_copy_on_writes: int
    num_sequences: int
    num_clients: int
    block_size: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., kv_utilization: _Optional[float] = ..., fragmentation: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_copy_on_writes: _Optional[int] = ..., num_sequences: _Optional[int] = ..., num_clients: _Optional[int] = ..., block_size: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("kind", "num_blocks", "num_bytes", "capacity_bytes", "num_hits", "num_misses", "num_bytes_written", "num_bytes_read", "num_write_errors", "num_bad_files", "num_loads", "num_loads_skipped", "num_blocks_missed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BAD_FILES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_MISSED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    num_hits: int
    num_misses: int
    num_bytes_written: int
    num_bytes_read: int
    num_write_errors: int
    num_bad_files: int
    num_loads: int
    num_loads_skipped: int
    num_blocks_missed: int
    def __init__(self, kind: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_bytes_written: _Optional[int] = ..., num_bytes_read: _Optional[int] = ..., num_write_errors: _Optional[int] = ..., num_bad_files: _Optional[int] = ..., num_loads: _Optional[int] = ..., num_loads_skipped: _Optional[int] = ..., num_blocks_missed: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckIntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckIntegrityResponse(_message.Message):
    __slots__ = ("ok", "problem")
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    problem: str
    def __init__(self, ok: _Optional[bool] = ..., problem: _Optional[str] = ...) -> None: ...
