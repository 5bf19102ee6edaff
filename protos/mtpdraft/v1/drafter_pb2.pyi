from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]
    DTYPE_FP32: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_BF16: DType
DTYPE_FP16: DType
DTYPE_FP32: DType
DTYPE_INT32: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_family", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "compute_dtype", "hidden_dtypes", "device", "max_drafts", "max_batch", "max_states", "live_states", "kv_block_size", "kv_blocks_total", "kv_blocks_free", "kv_handles", "state_ttl_seconds", "max_message_bytes", "bitmask_words", "draining", "batch_size_counts", "queued_calls", "instance_epoch", "model_fingerprint", "max_sample_top_k", "grammar_kinds")
    class BatchSizeCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_STATES_FIELD_NUMBER: _ClassVar[int]
    LIVE_STATES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLES_FIELD_NUMBER: _ClassVar[int]
    STATE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BITMASK_WORDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_CALLS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KINDS_FIELD_NUMBER: _ClassVar[int]
    model_family: str
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    compute_dtype: str
    hidden_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    device: str
    max_drafts: int
    max_batch: int
    max_states: int
    live_states: int
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_handles: int
    state_ttl_seconds: float
    max_message_bytes: int
    bitmask_words: int
    draining: bool
    batch_size_counts: _containers.ScalarMap[int, int]
    queued_calls: int
    instance_epoch: int
    model_fingerprint: str
    max_sample_top_k: int
    grammar_kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_family: _Optional[str] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_key_value_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., compute_dtype: _Optional[str] = ..., hidden_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., device: _Optional[str] = ..., max_drafts: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_states: _Optional[int] = ..., live_states: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_handles: _Optional[int] = ..., state_ttl_seconds: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., bitmask_words: _Optional[int] = ..., draining: bool = ..., batch_size_counts: _Optional[_Mapping[int, int]] = ..., queued_calls: _Optional[int] = ..., instance_epoch: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., max_sample_top_k: _Optional[int] = ..., grammar_kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "ebnf", "regex", "structural_tag", "none")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    ebnf: str
    regex: str
    structural_tag: str
    none: bool
    def __init__(self, json_schema: _Optional[str] = ..., ebnf: _Optional[str] = ..., regex: _Optional[str] = ..., structural_tag: _Optional[str] = ..., none: bool = ...) -> None: ...

class AllocStateRequest(_message.Message):
    __slots__ = ("sampling", "grammar")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    sampling: SamplingParams
    grammar: Grammar
    def __init__(self, sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class AllocStateResponse(_message.Message):
    __slots__ = ("state_id",)
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    def __init__(self, state_id: _Optional[int] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("state_id", "start_position", "tokens", "hiddens", "total_rows")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    start_position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    hiddens: Tensor
    total_rows: int
    def __init__(self, state_id: _Optional[int] = ..., start_position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., hiddens: _Optional[_Union[Tensor, _Mapping]] = ..., total_rows: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("num_rows", "next_position")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    next_position: int
    def __init__(self, num_rows: _Optional[int] = ..., next_position: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("num_accepted", "refeed_hiddens")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFEED_HIDDENS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    refeed_hiddens: Tensor
    def __init__(self, num_accepted: _Optional[int] = ..., refeed_hiddens: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("state_id", "token", "hidden", "position", "num_drafts", "bitmask", "min_confidence", "previous", "step_number", "sampling", "draft_cap", "verify_token_cost", "return_bitmasks", "grammar")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    STEP_NUMBER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CAP_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TOKEN_COST_FIELD_NUMBER: _ClassVar[int]
    RETURN_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    token: int
    hidden: Tensor
    position: int
    num_drafts: int
    bitmask: Tensor
    min_confidence: float
    previous: Verdict
    step_number: int
    sampling: SamplingParams
    draft_cap: int
    verify_token_cost: float
    return_bitmasks: bool
    grammar: Grammar
    def __init__(self, state_id: _Optional[int] = ..., token: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., position: _Optional[int] = ..., num_drafts: _Optional[int] = ..., bitmask: _Optional[_Union[Tensor, _Mapping]] = ..., min_confidence: _Optional[float] = ..., previous: _Optional[_Union[Verdict, _Mapping]] = ..., step_number: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., draft_cap: _Optional[int] = ..., verify_token_cost: _Optional[float] = ..., return_bitmasks: bool = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("state_id", "tokens", "probs", "confidence", "first_position", "q_support", "q_ids", "q_probs", "bitmasks")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    Q_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    BITMASKS_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    confidence: float
    first_position: int
    q_support: int
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    bitmasks: Tensor
    def __init__(self, state_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., confidence: _Optional[float] = ..., first_position: _Optional[int] = ..., q_support: _Optional[int] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ..., bitmasks: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "reason", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class ProposeBatchRequest(_message.Message):
    __slots__ = ("request_id", "state_ids", "tokens", "positions", "hiddens", "num_drafts", "num_accepted", "refeed_rows", "refeed_hiddens", "bitmask_rows", "bitmasks", "min_confidence", "step_numbers", "sampling_rows", "sampling", "draft_caps", "verify_token_costs", "return_bitmasks", "grammar_rows", "grammars")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HIDDENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFEED_ROWS_FIELD_NUMBER: _ClassVar[int]
    REFEED_HIDDENS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    BITMASKS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    STEP_NUMBERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_ROWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CAPS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TOKEN_COSTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    state_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    hiddens: Tensor
    num_drafts: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    refeed_rows: _containers.RepeatedScalarFieldContainer[int]
    refeed_hiddens: Tensor
    bitmask_rows: _containers.RepeatedScalarFieldContainer[int]
    bitmasks: Tensor
    min_confidence: _containers.RepeatedScalarFieldContainer[float]
    step_numbers: _containers.RepeatedScalarFieldContainer[int]
    sampling_rows: _containers.RepeatedScalarFieldContainer[int]
    sampling: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    draft_caps: _containers.RepeatedScalarFieldContainer[int]
    verify_token_costs: _containers.RepeatedScalarFieldContainer[float]
    return_bitmasks: bool
    grammar_rows: _containers.RepeatedScalarFieldContainer[int]
    grammars: _containers.RepeatedCompositeFieldContainer[Grammar]
    def __init__(self, request_id: _Optional[int] = ..., state_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., hiddens: _Optional[_Union[Tensor, _Mapping]] = ..., num_drafts: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., refeed_rows: _Optional[_Iterable[int]] = ..., refeed_hiddens: _Optional[_Union[Tensor, _Mapping]] = ..., bitmask_rows: _Optional[_Iterable[int]] = ..., bitmasks: _Optional[_Union[Tensor, _Mapping]] = ..., min_confidence: _Optional[_Iterable[float]] = ..., step_numbers: _Optional[_Iterable[int]] = ..., sampling_rows: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ..., draft_caps: _Optional[_Iterable[int]] = ..., verify_token_costs: _Optional[_Iterable[float]] = ..., return_bitmasks: bool = ..., grammar_rows: _Optional[_Iterable[int]] = ..., grammars: _Optional[_Iterable[_Union[Grammar, _Mapping]]] = ...) -> None: ...

class ProposeBatchResponse(_message.Message):
    __slots__ = ("request_id", "width", "drafts", "probs", "draft_counts", "confidences", "first_positions", "errors", "error", "q_support", "q_ids", "q_probs", "bitmask_rows", "bitmasks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    Q_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    BITMASKS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    width: int
    drafts: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    first_positions: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedCompositeFieldContainer[RowError]
    error: Error
    q_support: int
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    bitmask_rows: _containers.RepeatedScalarFieldContainer[int]
    bitmasks: Tensor
    def __init__(self, request_id: _Optional[int] = ..., width: _Optional[int] = ..., drafts: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ..., first_positions: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[_Union[RowError, _Mapping]]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., q_support: _Optional[int] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ..., bitmask_rows: _Optional[_Iterable[int]] = ..., bitmasks: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RowError(_message.Message):
    __slots__ = ("row", "error")
    ROW_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    row: int
    error: Error
    def __init__(self, row: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class AfterVerifyRequest(_message.Message):
    __slots__ = ("state_id", "verdict")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    verdict: Verdict
    def __init__(self, state_id: _Optional[int] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...

class AfterVerifyResponse(_message.Message):
    __slots__ = ("num_rows", "next_position")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    next_position: int
    def __init__(self, num_rows: _Optional[int] = ..., next_position: _Optional[int] = ...) -> None: ...

class TakeKVRequest(_message.Message):
    __slots__ = ("state_id",)
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    def __init__(self, state_id: _Optional[int] = ...) -> None: ...

class TakeKVResponse(_message.Message):
    __slots__ = ("handle_id", "num_rows", "ttl_seconds")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    handle_id: int
    num_rows: int
    ttl_seconds: float
    def __init__(self, handle_id: _Optional[int] = ..., num_rows: _Optional[int] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class InstallKVRequest(_message.Message):
    __slots__ = ("state_id", "handle_id")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    handle_id: int
    def __init__(self, state_id: _Optional[int] = ..., handle_id: _Optional[int] = ...) -> None: ...

class InstallKVResponse(_message.Message):
    __slots__ = ("num_rows", "next_position")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    next_position: int
    def __init__(self, num_rows: _Optional[int] = ..., next_position: _Optional[int] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("handle_id", "max_chunk_bytes", "keep_handle")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEEP_HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle_id: int
    max_chunk_bytes: int
    keep_handle: bool
    def __init__(self, handle_id: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., keep_handle: bool = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("model_fingerprint", "model_family", "dtype", "num_key_value_heads", "head_dim", "num_rows", "grammar", "grammar_tokens")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    model_family: str
    dtype: DType
    num_key_value_heads: int
    head_dim: int
    num_rows: int
    grammar: Grammar
    grammar_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_fingerprint: _Optional[str] = ..., model_family: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_key_value_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_rows: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., grammar_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("state_id", "header", "first_row", "k", "v")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    header: KVHeader
    first_row: int
    k: Tensor
    v: Tensor
    def __init__(self, state_id: _Optional[int] = ..., header: _Optional[_Union[KVHeader, _Mapping]] = ..., first_row: _Optional[int] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ImportKVResponse(_message.Message):
    __slots__ = ("num_rows", "next_position")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    next_position: int
    def __init__(self, num_rows: _Optional[int] = ..., next_position: _Optional[int] = ...) -> None: ...

class FreeStateRequest(_message.Message):
    __slots__ = ("state_id",)
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    state_id: int
    def __init__(self, state_id: _Optional[int] = ...) -> None: ...

class FreeStateResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: bool = ...) -> None: ...
