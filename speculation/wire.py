"""Names and versions of the wire, derived from the proto descriptors (one home: every layer reads them here).

Enum names are the proto's value names without their prefix, lower-cased (PROPOSER_NGRAM -> "ngram"); the
UNSPECIFIED value of an enum is "" (the default)."""

from __future__ import annotations

import grpc
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2

PROTOCOL_VERSION = max(common_pb2.ProtocolVersion.values())


def enum_names(enum, prefix: str) -> dict[str, int]:
    """{"name": value} of a proto enum, "" for its UNSPECIFIED value."""
    names = {}
    for key, value in enum.items():
        name = key.removeprefix(prefix).lower()
        names["" if name == "unspecified" else name] = value
    return names


PROPOSERS = enum_names(draft_pb2.Proposer, "PROPOSER_")  # "", dspark, ngram, hybrid
KERNELS = enum_names(draft_pb2.KernelChoice, "KERNEL_CHOICE_")  # "", fused, torch
PROPOSALS = enum_names(draft_pb2.ProposalKind, "PROPOSAL_KIND_")  # "", chain, tree
MODES = enum_names(common_pb2.DecodeMode, "DECODE_MODE_")  # "", ar, speculation, adaptive
PROPOSER_NAMES = {v: k for k, v in PROPOSERS.items()}
KERNEL_NAMES = {v: k for k, v in KERNELS.items()}
MODE_NAMES = {v: k for k, v in MODES.items()}
PROPOSAL_NAMES = {v: k for k, v in PROPOSALS.items()}

# Each name once, for code that means one of them (a test keeps these names' literals out of every other module).
AR, SPECULATION, ADAPTIVE = (MODE_NAMES[common_pb2.DECODE_MODE_AR], MODE_NAMES[common_pb2.DECODE_MODE_SPECULATION],
                             MODE_NAMES[common_pb2.DECODE_MODE_ADAPTIVE])
DSPARK, NGRAM, HYBRID = (PROPOSER_NAMES[draft_pb2.PROPOSER_DSPARK], PROPOSER_NAMES[draft_pb2.PROPOSER_NGRAM],
                         PROPOSER_NAMES[draft_pb2.PROPOSER_HYBRID])
CHAIN, TREE = PROPOSAL_NAMES[draft_pb2.PROPOSAL_KIND_CHAIN], PROPOSAL_NAMES[draft_pb2.PROPOSAL_KIND_TREE]
FUSED, TORCH = KERNEL_NAMES[draft_pb2.KERNEL_CHOICE_FUSED], KERNEL_NAMES[draft_pb2.KERNEL_CHOICE_TORCH]
AUTO = "auto"  # the kernel choice left to the drafter (KERNEL_CHOICE_UNSPECIFIED), as the CLI and the SDK spell it
DEFAULT_PROPOSER = "default"  # the drafter's default proposer (PROPOSER_UNSPECIFIED), as the CLI and the SDK spell it
# google.rpc.Code numbers -> names, as grpc.StatusCode spells them
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
