from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    D_TYPE_UNSPECIFIED: _ClassVar[DType]
    D_TYPE_FLOAT32: _ClassVar[DType]
    D_TYPE_FLOAT16: _ClassVar[DType]
    D_TYPE_BFLOAT16: _ClassVar[DType]
    D_TYPE_INT32: _ClassVar[DType]
    D_TYPE_INT64: _ClassVar[DType]
    D_TYPE_UINT8: _ClassVar[DType]
    D_TYPE_BOOL: _ClassVar[DType]

class DecodeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_MODE_UNSPECIFIED: _ClassVar[DecodeMode]
    DECODE_MODE_AR: _ClassVar[DecodeMode]
    DECODE_MODE_SPECULATION: _ClassVar[DecodeMode]
    DECODE_MODE_ADAPTIVE: _ClassVar[DecodeMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_FULL: _ClassVar[FinishReason]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
D_TYPE_UNSPECIFIED: DType
D_TYPE_FLOAT32: DType
D_TYPE_FLOAT16: DType
D_TYPE_BFLOAT16: DType
D_TYPE_INT32: DType
D_TYPE_INT64: DType
D_TYPE_UINT8: DType
D_TYPE_BOOL: DType
DECODE_MODE_UNSPECIFIED: DecodeMode
DECODE_MODE_AR: DecodeMode
DECODE_MODE_SPECULATION: DecodeMode
DECODE_MODE_ADAPTIVE: DecodeMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CONTEXT_FULL: FinishReason

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "child_token_ids", "child_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    CHILD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHILD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    child_token_ids: Tensor
    child_logprobs: Tensor
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., child_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., child_logprobs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class HiddenCapture(_message.Message):
    __slots__ = ("layer_ids", "start_position", "rows")
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    rows: Tensor
    def __init__(self, layer_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("model", "tokenizer")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer: str
    def __init__(self, model: _Optional[str] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class CostTable(_message.Message):
    __slots__ = ("lanes", "sizes", "seconds")
    LANES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    lanes: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, lanes: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "chat", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    tokens: TokenIds
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "steps", "mode_run", "acceptance_length", "per_position_acceptance", "prefill_seconds", "decode_seconds", "draft_seconds", "verify_seconds", "transport_seconds", "tokens_per_second", "ar_steps", "speculative_steps", "fallback_reason", "committed_per_step", "accepted_by_proposer", "drafted_per_position", "accepted_per_position", "planned_ar_steps", "truncated_drafts", "forward_sessions", "forward_rows", "draft_pass_sessions", "session_bytes", "capture_bytes", "drafts_ready", "drafts_from_chain", "drafts_from_lookup", "draft_rounds", "draft_round_seconds", "draft_service_seconds", "draft_compute_seconds")
    class AcceptedByProposerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MODE_RUN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PER_POSITION_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    AR_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_PROPOSER_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PLANNED_AR_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_READY_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FROM_CHAIN_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FROM_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SERVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    steps: int
    mode_run: DecodeMode
    acceptance_length: float
    per_position_acceptance: _containers.RepeatedScalarFieldContainer[float]
    prefill_seconds: float
    decode_seconds: float
    draft_seconds: float
    verify_seconds: float
    transport_seconds: float
    tokens_per_second: float
    ar_steps: int
    speculative_steps: int
    fallback_reason: str
    committed_per_step: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_proposer: _containers.ScalarMap[str, int]
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    planned_ar_steps: int
    truncated_drafts: int
    forward_sessions: float
    forward_rows: float
    draft_pass_sessions: float
    session_bytes: int
    capture_bytes: int
    drafts_ready: int
    drafts_from_chain: int
    drafts_from_lookup: int
    draft_rounds: int
    draft_round_seconds: float
    draft_service_seconds: float
    draft_compute_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., mode_run: _Optional[_Union[DecodeMode, str]] = ..., acceptance_length: _Optional[float] = ..., per_position_acceptance: _Optional[_Iterable[float]] = ..., prefill_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., transport_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., ar_steps: _Optional[int] = ..., speculative_steps: _Optional[int] = ..., fallback_reason: _Optional[str] = ..., committed_per_step: _Optional[_Iterable[int]] = ..., accepted_by_proposer: _Optional[_Mapping[str, int]] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., planned_ar_steps: _Optional[int] = ..., truncated_drafts: _Optional[int] = ..., forward_sessions: _Optional[float] = ..., forward_rows: _Optional[float] = ..., draft_pass_sessions: _Optional[float] = ..., session_bytes: _Optional[int] = ..., capture_bytes: _Optional[int] = ..., drafts_ready: _Optional[int] = ..., drafts_from_chain: _Optional[int] = ..., drafts_from_lookup: _Optional[int] = ..., draft_rounds: _Optional[int] = ..., draft_round_seconds: _Optional[float] = ..., draft_service_seconds: _Optional[float] = ..., draft_compute_seconds: _Optional[float] = ...) -> None: ...
