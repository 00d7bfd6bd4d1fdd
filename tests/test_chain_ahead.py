"""The rest of a chain cut by the round's plan as the next step's proposal (SessionDrafting.fit, chain_ahead),
torch-free: which outcomes reuse it, and what the reused proposal holds."""

from __future__ import annotations

import struct

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.speculation.tensors import float32_values
from dspark_grpc.target_service.steps import SessionDrafting

ANCHOR, CHAIN = 5, [11, 12, 13, 14, 15]
CONFIDENCES = [0.9, 0.8, 0.7, 0.6, 0.5]  # exact in float32


def drafting() -> SessionDrafting:
    return SessionDrafting("s", target_pb2.StepOptions(), draft_pb2.GetDrafterInfoResponse())


def proposal(sampled: bool = False) -> draft_pb2.Proposal:
    n = len(CHAIN)
    tree = common_pb2.TokenTree(tokens=[ANCHOR, *CHAIN], parents=list(range(-1, n)))
    if sampled:  # a sampled chain carries the distributions its tokens were drawn from
        tree.child_token_ids.CopyFrom(common_pb2.Tensor(dtype=common_pb2.D_TYPE_INT32, shape=[n + 1, 1],
                                                        data=struct.pack(f"<{n + 1}i", *CHAIN, -1)))
        tree.child_logprobs.CopyFrom(common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[n + 1, 1],
                                                       data=struct.pack(f"<{n + 1}f", *[0.0] * (n + 1))))
    return draft_pb2.Proposal(
        tree=tree, node_proposers=[0, 1, 1, 2, 1, 2],
        confidences=common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[n],
                                      data=struct.pack(f"<{n}f", *CONFIDENCES)))


def test_all_accepted_and_the_next_token_the_chains_next_reuses_the_rest():
    d = drafting()
    fitted = d.fit(proposal(), room=100, round_depth=2)
    assert list(fitted.tree.tokens) == [ANCHOR, 11, 12] and fitted.truncated
    # the target accepted 11, 12 and its next token is 13: the chain's rest starts there
    nxt = d.chain_ahead(accepted=2, next_token=13)
    assert nxt is not None
    assert list(nxt.tree.tokens) == [13, 14, 15] and list(nxt.tree.parents) == [-1, 0, 1]
    assert float32_values(nxt.confidences) == pytest.approx(CONFIDENCES[3:])  # of 14 and 15
    assert list(nxt.node_proposers) == [0, 1, 2]  # the root is the target's token
    assert d.chain_ahead(accepted=2, next_token=13) is None  # used once
    # it is fitted as a proposal: cut again by the next plan, its own rest kept
    again = d.fit(nxt, room=100, round_depth=1)
    assert list(again.tree.tokens) == [13, 14]
    last = d.chain_ahead(accepted=1, next_token=15)
    assert last is None  # a rest of one token has no draft left after its root


@pytest.mark.parametrize("accepted, next_token", [(1, 13), (2, 99), (0, 11)])
def test_a_rejection_or_another_next_token_drafts_a_new_round(accepted, next_token):
    d = drafting()
    d.fit(proposal(), room=100, round_depth=2)
    assert d.chain_ahead(accepted=accepted, next_token=next_token) is None


def test_no_rest_for_an_uncut_chain_a_sampled_chain_or_after_a_rollback():
    d = drafting()
    d.fit(proposal(), room=100, round_depth=len(CHAIN))  # all of it verified
    assert d.chain_ahead(accepted=len(CHAIN), next_token=99) is None
    d.fit(proposal(), room=100, round_depth=None)  # no plan: not cut
    assert d.rest is None
    d.fit(proposal(sampled=True), room=100, round_depth=2)  # its distributions are not carried over
    assert d.chain_ahead(accepted=2, next_token=13) is None
    d.fit(proposal(), room=100, round_depth=2)
    d.rollback(3)
    assert d.chain_ahead(accepted=2, next_token=13) is None


def test_the_contexts_room_bounds_the_rest():
    d = drafting()
    fitted = d.fit(proposal(), room=4, round_depth=1)  # room for the root and 3 draft tokens
    assert list(fitted.tree.tokens) == [ANCHOR, 11]
    nxt = d.chain_ahead(accepted=1, next_token=12)
    assert nxt is not None and list(nxt.tree.tokens) == [12, 13]
