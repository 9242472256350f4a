from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTED: _ClassVar[WorkerState]
    WORKER_STATE_INITIALIZED: _ClassVar[WorkerState]
    WORKER_STATE_LOADED: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTED: WorkerState
WORKER_STATE_INITIALIZED: WorkerState
WORKER_STATE_LOADED: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_FAILED: WorkerState

class EngineConfig(_message.Message):
    __slots__ = ("model", "tokenizer", "tensor_parallel_size", "pipeline_parallel_size", "pp_layer_partition", "device", "dtype", "load_format", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "block_events", "kv_cache_dtype", "quantization", "num_kv_blocks", "kv_cache_memory_gb", "gpu_memory_utilization", "attention_backend", "split_mixed_decodes", "enforce_eager", "async_scheduling", "seed", "dist_timeout_s", "speculative_config")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SPLIT_MIXED_DECODES_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_EAGER_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DIST_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pp_layer_partition: str
    device: str
    dtype: str
    load_format: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    block_events: bool
    kv_cache_dtype: str
    quantization: str
    num_kv_blocks: int
    kv_cache_memory_gb: float
    gpu_memory_utilization: float
    attention_backend: str
    split_mixed_decodes: int
    enforce_eager: bool
    async_scheduling: bool
    seed: int
    dist_timeout_s: float
    speculative_config: str
    def __init__(self, model: _Optional[str] = ..., tokenizer: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., pp_layer_partition: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., load_format: _Optional[str] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., block_events: _Optional[bool] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., kv_cache_memory_gb: _Optional[float] = ..., gpu_memory_utilization: _Optional[float] = ..., attention_backend: _Optional[str] = ..., split_mixed_decodes: _Optional[int] = ..., enforce_eager: _Optional[bool] = ..., async_scheduling: _Optional[bool] = ..., seed: _Optional[int] = ..., dist_timeout_s: _Optional[float] = ..., speculative_config: _Optional[str] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("rank", "world_size", "init_method", "device", "config")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    init_method: str
    device: str
    config: EngineConfig
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., init_method: _Optional[str] = ..., device: _Optional[str] = ..., config: _Optional[_Union[EngineConfig, _Mapping]] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("pid", "hostname", "device_name")
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    pid: int
    hostname: str
    device_name: str
    def __init__(self, pid: _Optional[int] = ..., hostname: _Optional[str] = ..., device_name: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("weight_bytes", "load_s")
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    weight_bytes: int
    load_s: float
    def __init__(self, weight_bytes: _Optional[int] = ..., load_s: _Optional[float] = ...) -> None: ...

class ProfileMemoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileMemoryResponse(_message.Message):
    __slots__ = ("num_blocks", "block_bytes", "host_id", "host_available_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_bytes: int
    host_id: str
    host_available_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., host_id: _Optional[str] = ..., host_available_bytes: _Optional[int] = ...) -> None: ...

class AllocateKVCacheRequest(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class AllocateKVCacheResponse(_message.Message):
    __slots__ = ("num_blocks", "kv_cache_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    kv_cache_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ...) -> None: ...

class SamplingSpec(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs", "min_tokens", "stop_token_ids", "prompt_logprobs", "logit_bias", "grammar_kind", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logprobs: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    grammar_kind: str
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar_kind: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_ids", "sampling")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingSpec
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingSpec, _Mapping]] = ...) -> None: ...

class NewBlocks(_message.Message):
    __slots__ = ("req_id", "block_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "req_ids", "num_tokens", "new_block_ids", "finished_req_ids", "preempted_req_ids", "draft_token_ids", "sampled_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedCompositeFieldContainer[NewBlocks]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_req_ids: _containers.RepeatedScalarFieldContainer[str]
    draft_token_ids: _containers.RepeatedCompositeFieldContainer[DraftTokens]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., req_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[_Union[NewBlocks, _Mapping]]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., preempted_req_ids: _Optional[_Iterable[str]] = ..., draft_token_ids: _Optional[_Iterable[_Union[DraftTokens, _Mapping]]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftTokens(_message.Message):
    __slots__ = ("req_id", "token_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepLogprobs(_message.Message):
    __slots__ = ("index", "logprob", "top_counts", "top_ids", "top_logprobs", "rank")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedScalarFieldContainer[int]
    logprob: _containers.RepeatedScalarFieldContainer[float]
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[_Iterable[int]] = ..., logprob: _Optional[_Iterable[float]] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "start", "logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start: int
    logprobs: StepLogprobs
    def __init__(self, req_id: _Optional[str] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Union[StepLogprobs, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "rank", "req_ids", "token_ids", "logprobs", "forward_ms", "error", "prompt_logprobs", "grammar_mask_ms")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_MASK_MS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rank: int
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: StepLogprobs
    forward_ms: float
    error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    grammar_mask_ms: float
    def __init__(self, step_id: _Optional[int] = ..., rank: _Optional[int] = ..., req_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[StepLogprobs, _Mapping]] = ..., forward_ms: _Optional[float] = ..., error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., grammar_mask_ms: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("state", "last_step_id", "error")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    last_step_id: int
    error: str
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., last_step_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
