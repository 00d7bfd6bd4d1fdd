"""A session whose drafter goes away re-opens on another drafter of the pool with its whole context, without gRPC:
the real engine (the default model, fast precision) steps a session drafting with an oracle over fake link streams;
the first drafter's stream breaks after a few rounds. The tokens stay the engine's own AR tokens, the second drafter
is given the rows (tokens and captures, byte for byte) that the first was given, and drafting goes on there."""

from __future__ import annotations

from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.speculation.generation import RequestError
from dspark_grpc.speculation.tensors import concat_rows
from dspark_grpc.target_service.draft_rounds import DraftRounds
from dspark_grpc.target_service.drafter_pool import Drafter, DrafterPool
from dspark_grpc.target_service.servicer import TargetServicer
from dspark_grpc.target_service.steps import SessionDrafting, joined_appends

from tests.service.test_chain_ahead_steps import OracleLink, oracle, run
from tests.test_draft_rounds import FakeStream


class BreakingStream(FakeStream):
    """Answers `rounds` rounds, then fails as a stream to a killed drafter does (calling `on_break` first)."""

    def __init__(self, rounds: int, on_break, **kwargs) -> None:
        super().__init__(**kwargs)
        self.left, self.on_break = rounds, on_break

    def call(self, request, timeout=None):
        if self.left == 0:
            self.on_break()
            raise RequestError(14, "Socket closed")
        self.left -= 1
        return super().call(request, timeout)


def given_rows(rounds: list[draft_pb2.DraftRound]) -> tuple[list[int], bytes]:
    """The tokens and capture bytes a drafter was given over its rounds, in position order."""
    appends = [op.append for r in rounds for op in joined_appends(list(r.ops)) if op.WhichOneof("op") == "append"]
    assert [a.start_position for a in appends] == sorted(a.start_position for a in appends)
    tokens = [t for a in appends for t in a.tokens]
    assert appends[0].start_position == 0
    assert all(a.capture.rows.shape[0] == len(a.tokens) for a in appends)
    return tokens, concat_rows([a.capture.rows for a in appends]).data


def test_a_session_moves_to_the_other_drafter_with_its_context_and_keeps_drafting(fast_engine):
    engine = fast_engine
    ar_servicer = TargetServicer(64 << 20)
    ar_servicer.engine = engine
    ar, _, _, prompt_length = run(ar_servicer, common_pb2.DECODE_MODE_AR)
    greedy = {prompt_length + i: t for i, t in enumerate(ar)}
    greedy.update({prompt_length + len(ar) + i: 0 for i in range(8)})

    servicer = TargetServicer(64 << 20)
    servicer.engine = engine
    second = OracleLink(FakeStream(proposal=oracle(greedy)))
    # the session starts on the first drafter whatever its id hashes to: the second answers once the first broke
    second.info, info = None, second.info
    first = OracleLink(BreakingStream(3, lambda: setattr(second, "info", info), proposal=oracle(greedy)))
    first.address, second.address = "first:1", "second:1"
    steps = servicer.steps
    drafters = {link.address: Drafter(link, DraftRounds(link, None, steps._round_drafted, steps._plan_round))
                for link in (first, second)}
    servicer.steps.drafters = DrafterPool("first:1,second:1", lambda address, _: drafters[address])
    try:
        spec, reports, _, _ = run(servicer, common_pb2.DECODE_MODE_SPECULATION)
    finally:
        for d in drafters.values():
            d.rounds.close()
    assert spec == ar

    moved = [i for i, r in enumerate(reports) if "drafting moved to second:1" in r.fallback_reason]
    assert len(moved) == 1, [r.fallback_reason for r in reports]
    assert "Socket closed" in reports[moved[0]].fallback_reason
    assert not any("target-only" in r.fallback_reason for r in reports)
    assert reports[moved[0]].draft_depth == 0  # the step whose round failed verified its pending token alone
    assert sum(r.draft_depth > 0 for r in reports[moved[0] + 1:]) > 0  # drafting went on, on the second drafter

    before, after = first.stream.rounds, second.stream.rounds
    assert after[0].ops[0].WhichOneof("op") == "open"
    # the second drafter's first round re-sends every row up to its anchor: the rows the first was given, then the
    # ones committed since
    tokens_first, rows_first = given_rows(before)
    tokens_second, rows_second = given_rows(after[:1])
    anchor = next(op.propose for op in after[0].ops if op.WhichOneof("op") == "propose")
    assert len(tokens_second) == anchor.anchor_position
    assert tokens_second[: len(tokens_first)] == tokens_first
    assert rows_second[: len(rows_first)] == rows_first
    assert tokens_second[prompt_length:] == ar[: anchor.anchor_position - prompt_length]


def test_rolled_back_context_is_what_a_move_re_sends():
    rows = lambda n, first: common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[n, 2],  # noqa: E731
                                              data=bytes(range(first * 8, (first + n) * 8)))
    options = target_pb2.StepOptions(mode=common_pb2.DECODE_MODE_SPECULATION)
    d = SessionDrafting.start("s", options, draft_pb2.GetDrafterInfoResponse(), common_pb2.Fingerprint(model="m"),
                              None, 0, movable=True)
    d.append(0, [1, 2, 3, 4], common_pb2.HiddenCapture(layer_ids=[1], start_position=0, rows=rows(4, 0)))
    d.append(4, [5, 6], common_pb2.HiddenCapture(layer_ids=[1], start_position=4, rows=rows(2, 4)))
    d.round_ops(6, 6, draft_pb2.PROPOSER_DSPARK)  # all of it sent
    d.rollback(5)  # the last row is gone
    d.append(5, [9], common_pb2.HiddenCapture(layer_ids=[1], start_position=5, rows=rows(1, 20)))
    assert d.reopen("drafter gone", "other:1")
    ops = d.round_ops(9, 6, draft_pb2.PROPOSER_DSPARK)
    assert [op.WhichOneof("op") for op in ops] == ["open", "append", "propose"]
    assert ops[0].open.target.model == "m"
    append = ops[1].append
    assert (append.start_position, list(append.tokens)) == (0, [1, 2, 3, 4, 5, 9])
    assert append.capture.rows.data == bytes(range(0, 40)) + bytes(range(160, 168))
    assert list(append.capture.rows.shape) == [6, 2]


def test_a_session_moves_at_most_a_few_times_and_never_without_a_pool():
    options = target_pb2.StepOptions(mode=common_pb2.DECODE_MODE_SPECULATION)
    info = draft_pb2.GetDrafterInfoResponse()
    alone = SessionDrafting.start("s", options, info, common_pb2.Fingerprint(), None, 0)
    assert not alone.reopen("gone", "x:1")  # one drafter: no context kept, nowhere to go
    pooled = SessionDrafting.start("s", options, info, common_pb2.Fingerprint(), None, 0, movable=True)
    moves = 0
    while pooled.reopen("gone", "x:1"):
        moves += 1
    assert 1 <= moves <= 5
    pooled.fail("broken")
    assert not pooled.active
