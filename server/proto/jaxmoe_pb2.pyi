from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    priority: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta_text", "delta_token_ids", "logprobs", "finish_reason", "usage", "priority", "ttft_s", "tpot_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_TEXT_FIELD_NUMBER: _ClassVar[int]
    DELTA_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta_text: str
    delta_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    priority: str
    ttft_s: float
    tpot_s: float
    def __init__(self, request_id: _Optional[str] = ..., delta_text: _Optional[str] = ..., delta_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., priority: _Optional[str] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "family", "vocab_size", "max_context", "num_layers", "num_moe_layers", "num_experts", "experts_per_token", "mesh", "policy", "max_num_seqs", "num_kv_blocks", "kv_block_size", "op_impls")
    class OpImplsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    OP_IMPLS_FIELD_NUMBER: _ClassVar[int]
    model: str
    family: str
    vocab_size: int
    max_context: int
    num_layers: int
    num_moe_layers: int
    num_experts: int
    experts_per_token: int
    mesh: str
    policy: str
    max_num_seqs: int
    num_kv_blocks: int
    kv_block_size: int
    op_impls: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., family: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_moe_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., mesh: _Optional[str] = ..., policy: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., op_impls: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RescaleRequest(_message.Message):
    __slots__ = ("attention", "experts", "slots_per_instance")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    attention: int
    experts: int
    slots_per_instance: int
    def __init__(self, attention: _Optional[int] = ..., experts: _Optional[int] = ..., slots_per_instance: _Optional[int] = ...) -> None: ...

class RescaleResponse(_message.Message):
    __slots__ = ("attention", "experts", "slots_per_instance", "previous", "build_s", "swap_s", "first_step_s", "normal_step_s", "stall_ratio", "kv_blocks_moved", "sequences_recomputed", "expert_slots_local", "expert_slots_copied", "expert_bytes_copied")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    BUILD_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    NORMAL_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STALL_RATIO_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SLOTS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SLOTS_COPIED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    attention: int
    experts: int
    slots_per_instance: int
    previous: str
    build_s: float
    swap_s: float
    first_step_s: float
    normal_step_s: float
    stall_ratio: float
    kv_blocks_moved: int
    sequences_recomputed: int
    expert_slots_local: int
    expert_slots_copied: int
    expert_bytes_copied: int
    def __init__(self, attention: _Optional[int] = ..., experts: _Optional[int] = ..., slots_per_instance: _Optional[int] = ..., previous: _Optional[str] = ..., build_s: _Optional[float] = ..., swap_s: _Optional[float] = ..., first_step_s: _Optional[float] = ..., normal_step_s: _Optional[float] = ..., stall_ratio: _Optional[float] = ..., kv_blocks_moved: _Optional[int] = ..., sequences_recomputed: _Optional[int] = ..., expert_slots_local: _Optional[int] = ..., expert_slots_copied: _Optional[int] = ..., expert_bytes_copied: _Optional[int] = ...) -> None: ...
