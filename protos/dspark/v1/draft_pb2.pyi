from dspark_grpc.protos.dspark.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_UNSPECIFIED: _ClassVar[Proposer]
    PROPOSER_DSPARK: _ClassVar[Proposer]
    PROPOSER_NGRAM: _ClassVar[Proposer]
    PROPOSER_HYBRID: _ClassVar[Proposer]

class SlotConvention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_CONVENTION_UNSPECIFIED: _ClassVar[SlotConvention]
    SLOT_CONVENTION_DSPARK: _ClassVar[SlotConvention]
    SLOT_CONVENTION_DFLASH: _ClassVar[SlotConvention]

class ProposalKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSAL_KIND_UNSPECIFIED: _ClassVar[ProposalKind]
    PROPOSAL_KIND_CHAIN: _ClassVar[ProposalKind]
    PROPOSAL_KIND_TREE: _ClassVar[ProposalKind]

class KernelChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KERNEL_CHOICE_UNSPECIFIED: _ClassVar[KernelChoice]
    KERNEL_CHOICE_FUSED: _ClassVar[KernelChoice]
    KERNEL_CHOICE_TORCH: _ClassVar[KernelChoice]
PROPOSER_UNSPECIFIED: Proposer
PROPOSER_DSPARK: Proposer
PROPOSER_NGRAM: Proposer
PROPOSER_HYBRID: Proposer
SLOT_CONVENTION_UNSPECIFIED: SlotConvention
SLOT_CONVENTION_DSPARK: SlotConvention
SLOT_CONVENTION_DFLASH: SlotConvention
PROPOSAL_KIND_UNSPECIFIED: ProposalKind
PROPOSAL_KIND_CHAIN: ProposalKind
PROPOSAL_KIND_TREE: ProposalKind
KERNEL_CHOICE_UNSPECIFIED: KernelChoice
KERNEL_CHOICE_FUSED: KernelChoice
KERNEL_CHOICE_TORCH: KernelChoice

class GetDrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDrafterInfoResponse(_message.Message):
    __slots__ = ("name", "block_size", "target_layer_ids", "mask_token_id", "vocab_size", "target", "protocol_version", "slot_convention", "markov_rank", "has_confidence_head", "proposers", "default_proposer", "max_sessions", "max_tree_budget", "max_message_bytes", "live_sessions", "session_socket", "prompt_lookup")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOT_CONVENTION_FIELD_NUMBER: _ClassVar[int]
    MARKOV_RANK_FIELD_NUMBER: _ClassVar[int]
    HAS_CONFIDENCE_HEAD_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROPOSER_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    mask_token_id: int
    vocab_size: int
    target: _common_pb2.Fingerprint
    protocol_version: _common_pb2.ProtocolVersion
    slot_convention: SlotConvention
    markov_rank: int
    has_confidence_head: bool
    proposers: _containers.RepeatedScalarFieldContainer[Proposer]
    default_proposer: Proposer
    max_sessions: int
    max_tree_budget: int
    max_message_bytes: int
    live_sessions: int
    session_socket: str
    prompt_lookup: PromptLookupSettings
    def __init__(self, name: _Optional[str] = ..., block_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., mask_token_id: _Optional[int] = ..., vocab_size: _Optional[int] = ..., target: _Optional[_Union[_common_pb2.Fingerprint, _Mapping]] = ..., protocol_version: _Optional[_Union[_common_pb2.ProtocolVersion, str]] = ..., slot_convention: _Optional[_Union[SlotConvention, str]] = ..., markov_rank: _Optional[int] = ..., has_confidence_head: _Optional[bool] = ..., proposers: _Optional[_Iterable[_Union[Proposer, str]]] = ..., default_proposer: _Optional[_Union[Proposer, str]] = ..., max_sessions: _Optional[int] = ..., max_tree_budget: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., live_sessions: _Optional[int] = ..., session_socket: _Optional[str] = ..., prompt_lookup: _Optional[_Union[PromptLookupSettings, _Mapping]] = ...) -> None: ...

class PromptLookupSettings(_message.Message):
    __slots__ = ("min_ngram", "max_ngram", "chain_tokens", "hybrid_min_match")
    MIN_NGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_FIELD_NUMBER: _ClassVar[int]
    CHAIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HYBRID_MIN_MATCH_FIELD_NUMBER: _ClassVar[int]
    min_ngram: int
    max_ngram: int
    chain_tokens: int
    hybrid_min_match: int
    def __init__(self, min_ngram: _Optional[int] = ..., max_ngram: _Optional[int] = ..., chain_tokens: _Optional[int] = ..., hybrid_min_match: _Optional[int] = ...) -> None: ...

class DraftSessionRequest(_message.Message):
    __slots__ = ("request_id", "open", "append", "propose", "truncate", "release", "round")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    open: OpenDraft
    append: AppendContext
    propose: Propose
    truncate: TruncateContext
    release: ReleaseDraft
    round: DraftRound
    def __init__(self, request_id: _Optional[int] = ..., open: _Optional[_Union[OpenDraft, _Mapping]] = ..., append: _Optional[_Union[AppendContext, _Mapping]] = ..., propose: _Optional[_Union[Propose, _Mapping]] = ..., truncate: _Optional[_Union[TruncateContext, _Mapping]] = ..., release: _Optional[_Union[ReleaseDraft, _Mapping]] = ..., round: _Optional[_Union[DraftRound, _Mapping]] = ...) -> None: ...

class DraftSessionResponse(_message.Message):
    __slots__ = ("request_id", "status", "opened", "appended", "proposal", "truncated", "released", "round")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    status: _common_pb2.Status
    opened: DraftOpened
    appended: ContextAppended
    proposal: Proposal
    truncated: ContextTruncated
    released: DraftReleased
    round: DraftRoundResult
    def __init__(self, request_id: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., opened: _Optional[_Union[DraftOpened, _Mapping]] = ..., appended: _Optional[_Union[ContextAppended, _Mapping]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., truncated: _Optional[_Union[ContextTruncated, _Mapping]] = ..., released: _Optional[_Union[DraftReleased, _Mapping]] = ..., round: _Optional[_Union[DraftRoundResult, _Mapping]] = ...) -> None: ...

class DraftRound(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[DraftSessionRequest]
    def __init__(self, ops: _Optional[_Iterable[_Union[DraftSessionRequest, _Mapping]]] = ...) -> None: ...

class DraftRoundResult(_message.Message):
    __slots__ = ("results", "handle_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftSessionResponse]
    handle_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[DraftSessionResponse, _Mapping]]] = ..., handle_seconds: _Optional[float] = ...) -> None: ...

class OpenDraft(_message.Message):
    __slots__ = ("protocol_version", "target", "session_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: _common_pb2.ProtocolVersion
    target: _common_pb2.Fingerprint
    session_id: str
    def __init__(self, protocol_version: _Optional[_Union[_common_pb2.ProtocolVersion, str]] = ..., target: _Optional[_Union[_common_pb2.Fingerprint, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class DraftOpened(_message.Message):
    __slots__ = ("session_id", "target_layer_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., target_layer_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendContext(_message.Message):
    __slots__ = ("session_id", "start_position", "tokens", "capture")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start_position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    capture: _common_pb2.HiddenCapture
    def __init__(self, session_id: _Optional[str] = ..., start_position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., capture: _Optional[_Union[_common_pb2.HiddenCapture, _Mapping]] = ...) -> None: ...

class ContextAppended(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class Propose(_message.Message):
    __slots__ = ("session_id", "anchor_token", "anchor_position", "kind", "budget", "kernel", "proposer", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_POSITION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    anchor_token: int
    anchor_position: int
    kind: ProposalKind
    budget: int
    kernel: KernelChoice
    proposer: Proposer
    sampling: _common_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., anchor_token: _Optional[int] = ..., anchor_position: _Optional[int] = ..., kind: _Optional[_Union[ProposalKind, str]] = ..., budget: _Optional[int] = ..., kernel: _Optional[_Union[KernelChoice, str]] = ..., proposer: _Optional[_Union[Proposer, str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("tree", "confidences", "node_proposers", "compute_seconds", "batch_sessions")
    TREE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    NODE_PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.TokenTree
    confidences: _common_pb2.Tensor
    node_proposers: _containers.RepeatedScalarFieldContainer[Proposer]
    compute_seconds: float
    batch_sessions: int
    def __init__(self, tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., confidences: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., node_proposers: _Optional[_Iterable[_Union[Proposer, str]]] = ..., compute_seconds: _Optional[float] = ..., batch_sessions: _Optional[int] = ...) -> None: ...

class TruncateContext(_message.Message):
    __slots__ = ("session_id", "length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class ContextTruncated(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class ReleaseDraft(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftReleased(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
