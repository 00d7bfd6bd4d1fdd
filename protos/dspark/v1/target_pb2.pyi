from dspark_grpc.protos.dspark.v1 import common_pb2 as _common_pb2
from dspark_grpc.protos.dspark.v1 import draft_pb2 as _draft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogitsReturn(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGITS_RETURN_UNSPECIFIED: _ClassVar[LogitsReturn]
    LOGITS_RETURN_NONE: _ClassVar[LogitsReturn]
    LOGITS_RETURN_ALL: _ClassVar[LogitsReturn]
LOGITS_RETURN_UNSPECIFIED: LogitsReturn
LOGITS_RETURN_NONE: LogitsReturn
LOGITS_RETURN_ALL: LogitsReturn

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "num_layers", "hidden_size", "vocab_size", "max_context_length", "compute_dtype", "device", "fingerprint", "protocol_version", "eos_token_ids", "max_sessions", "max_tree_nodes", "max_message_bytes", "speculation_available", "default_mode", "verify_costs", "live_sessions")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context_length: int
    compute_dtype: _common_pb2.DType
    device: str
    fingerprint: _common_pb2.Fingerprint
    protocol_version: _common_pb2.ProtocolVersion
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_sessions: int
    max_tree_nodes: int
    max_message_bytes: int
    speculation_available: bool
    default_mode: _common_pb2.DecodeMode
    verify_costs: _containers.RepeatedCompositeFieldContainer[_common_pb2.CostTable]
    live_sessions: int
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., compute_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., device: _Optional[str] = ..., fingerprint: _Optional[_Union[_common_pb2.Fingerprint, _Mapping]] = ..., protocol_version: _Optional[_Union[_common_pb2.ProtocolVersion, str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_sessions: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., speculation_available: _Optional[bool] = ..., default_mode: _Optional[_Union[_common_pb2.DecodeMode, str]] = ..., verify_costs: _Optional[_Iterable[_Union[_common_pb2.CostTable, _Mapping]]] = ..., live_sessions: _Optional[int] = ...) -> None: ...

class TargetSessionRequest(_message.Message):
    __slots__ = ("request_id", "open", "prefill", "verify", "commit", "rollback", "release", "step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    open: OpenSession
    prefill: Prefill
    verify: Verify
    commit: Commit
    rollback: Rollback
    release: Release
    step: Step
    def __init__(self, request_id: _Optional[int] = ..., open: _Optional[_Union[OpenSession, _Mapping]] = ..., prefill: _Optional[_Union[Prefill, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., rollback: _Optional[_Union[Rollback, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ...) -> None: ...

class TargetSessionResponse(_message.Message):
    __slots__ = ("request_id", "status", "opened", "prefilled", "verified", "committed", "rolled_back", "released", "stepped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    status: _common_pb2.Status
    opened: SessionOpened
    prefilled: Prefilled
    verified: Verified
    committed: Committed
    rolled_back: RolledBack
    released: SessionReleased
    stepped: Stepped
    def __init__(self, request_id: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., prefilled: _Optional[_Union[Prefilled, _Mapping]] = ..., verified: _Optional[_Union[Verified, _Mapping]] = ..., committed: _Optional[_Union[Committed, _Mapping]] = ..., rolled_back: _Optional[_Union[RolledBack, _Mapping]] = ..., released: _Optional[_Union[SessionReleased, _Mapping]] = ..., stepped: _Optional[_Union[Stepped, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("protocol_version", "capture_layer_ids", "drafter_target", "max_length", "step_options")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_TARGET_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEP_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: _common_pb2.ProtocolVersion
    capture_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter_target: _common_pb2.Fingerprint
    max_length: int
    step_options: StepOptions
    def __init__(self, protocol_version: _Optional[_Union[_common_pb2.ProtocolVersion, str]] = ..., capture_layer_ids: _Optional[_Iterable[int]] = ..., drafter_target: _Optional[_Union[_common_pb2.Fingerprint, _Mapping]] = ..., max_length: _Optional[int] = ..., step_options: _Optional[_Union[StepOptions, _Mapping]] = ...) -> None: ...

class StepOptions(_message.Message):
    __slots__ = ("mode", "proposal", "budget", "kernel", "proposer")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.DecodeMode
    proposal: _draft_pb2.ProposalKind
    budget: int
    kernel: _draft_pb2.KernelChoice
    proposer: _draft_pb2.Proposer
    def __init__(self, mode: _Optional[_Union[_common_pb2.DecodeMode, str]] = ..., proposal: _Optional[_Union[_draft_pb2.ProposalKind, str]] = ..., budget: _Optional[int] = ..., kernel: _Optional[_Union[_draft_pb2.KernelChoice, str]] = ..., proposer: _Optional[_Union[_draft_pb2.Proposer, str]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "fingerprint", "max_length", "step_mode", "fallback_reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEP_MODE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    fingerprint: _common_pb2.Fingerprint
    max_length: int
    step_mode: _common_pb2.DecodeMode
    fallback_reason: str
    def __init__(self, session_id: _Optional[str] = ..., fingerprint: _Optional[_Union[_common_pb2.Fingerprint, _Mapping]] = ..., max_length: _Optional[int] = ..., step_mode: _Optional[_Union[_common_pb2.DecodeMode, str]] = ..., fallback_reason: _Optional[str] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("session_id", "prompt", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: _common_pb2.Prompt
    sampling: _common_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class Prefilled(_message.Message):
    __slots__ = ("prompt_tokens", "next_token", "capture", "text")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    capture: _common_pb2.HiddenCapture
    text: str
    def __init__(self, prompt_tokens: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ..., capture: _Optional[_Union[_common_pb2.HiddenCapture, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("session_id", "tree", "commit", "return_logits")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _common_pb2.TokenTree
    commit: bool
    return_logits: LogitsReturn
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., commit: _Optional[bool] = ..., return_logits: _Optional[_Union[LogitsReturn, str]] = ...) -> None: ...

class Verified(_message.Message):
    __slots__ = ("accepted_path", "next_token", "committed", "capture", "logits", "token_texts", "length", "compute_seconds", "batch_sessions", "batch_rows")
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    committed: bool
    capture: _common_pb2.HiddenCapture
    logits: _common_pb2.Tensor
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    length: int
    compute_seconds: float
    batch_sessions: int
    batch_rows: int
    def __init__(self, accepted_path: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ..., committed: _Optional[bool] = ..., capture: _Optional[_Union[_common_pb2.HiddenCapture, _Mapping]] = ..., logits: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., token_texts: _Optional[_Iterable[str]] = ..., length: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., batch_sessions: _Optional[int] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("session_id", "path", "next_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ...) -> None: ...

class Committed(_message.Message):
    __slots__ = ("capture", "token_texts", "length")
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    capture: _common_pb2.HiddenCapture
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    length: int
    def __init__(self, capture: _Optional[_Union[_common_pb2.HiddenCapture, _Mapping]] = ..., token_texts: _Optional[_Iterable[str]] = ..., length: _Optional[int] = ...) -> None: ...

class Rollback(_message.Message):
    __slots__ = ("session_id", "length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class RolledBack(_message.Message):
    __slots__ = ("length", "pending_token")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    length: int
    pending_token: int
    def __init__(self, length: _Optional[int] = ..., pending_token: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("session_id", "tokens_left")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LEFT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens_left: int
    def __init__(self, session_id: _Optional[str] = ..., tokens_left: _Optional[int] = ...) -> None: ...

class Stepped(_message.Message):
    __slots__ = ("tokens", "next_token", "token_texts", "length", "report")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    length: int
    report: StepReport
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ..., token_texts: _Optional[_Iterable[str]] = ..., length: _Optional[int] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("draft_depth", "tree_nodes", "accepted_proposers", "draft_seconds", "verify_seconds", "batch_sessions", "batch_rows", "draft_batch_sessions", "planned_ar", "truncated", "draft_ready", "fallback_reason", "draft_from_chain", "draft_from_lookup", "round_seconds", "round_drafter_seconds", "draft_compute_seconds")
    DRAFT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_AR_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_READY_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FROM_CHAIN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FROM_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_DRAFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    draft_depth: int
    tree_nodes: int
    accepted_proposers: _containers.RepeatedScalarFieldContainer[_draft_pb2.Proposer]
    draft_seconds: float
    verify_seconds: float
    batch_sessions: int
    batch_rows: int
    draft_batch_sessions: int
    planned_ar: bool
    truncated: bool
    draft_ready: bool
    fallback_reason: str
    draft_from_chain: bool
    draft_from_lookup: bool
    round_seconds: float
    round_drafter_seconds: float
    draft_compute_seconds: float
    def __init__(self, draft_depth: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., accepted_proposers: _Optional[_Iterable[_Union[_draft_pb2.Proposer, str]]] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., batch_sessions: _Optional[int] = ..., batch_rows: _Optional[int] = ..., draft_batch_sessions: _Optional[int] = ..., planned_ar: _Optional[bool] = ..., truncated: _Optional[bool] = ..., draft_ready: _Optional[bool] = ..., fallback_reason: _Optional[str] = ..., draft_from_chain: _Optional[bool] = ..., draft_from_lookup: _Optional[bool] = ..., round_seconds: _Optional[float] = ..., round_drafter_seconds: _Optional[float] = ..., draft_compute_seconds: _Optional[float] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionReleased(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "max_new_tokens", "sampling", "stop", "mode", "ignore_eos", "proposal", "budget", "kernel", "proposer")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    prompt: _common_pb2.Prompt
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    mode: _common_pb2.DecodeMode
    ignore_eos: bool
    proposal: _draft_pb2.ProposalKind
    budget: int
    kernel: _draft_pb2.KernelChoice
    proposer: _draft_pb2.Proposer
    def __init__(self, prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., mode: _Optional[_Union[_common_pb2.DecodeMode, str]] = ..., ignore_eos: _Optional[bool] = ..., proposal: _Optional[_Union[_draft_pb2.ProposalKind, str]] = ..., budget: _Optional[int] = ..., kernel: _Optional[_Union[_draft_pb2.KernelChoice, str]] = ..., proposer: _Optional[_Union[_draft_pb2.Proposer, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.GenerationStats
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.GenerationStats, _Mapping]] = ...) -> None: ...
