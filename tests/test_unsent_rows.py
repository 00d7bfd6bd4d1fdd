"""The captures of committed rows wait, as the target holds them, until the session's next round: one append per
run of consecutive rows, encoded once (SessionDrafting.append_rows), torch-free (rows are opaque here)."""

from __future__ import annotations

from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.target_service.steps import SessionDrafting


def drafting(encoded: list) -> SessionDrafting:
    d = SessionDrafting("s", target_pb2.StepOptions(), draft_pb2.GetDrafterInfoResponse())

    def encode(start: int, rows: list) -> common_pb2.HiddenCapture:
        encoded.append((start, list(rows)))
        return common_pb2.HiddenCapture(layer_ids=[3], start_position=start)

    d.encode_rows = encode
    return d


def ops_of(ops: list[draft_pb2.DraftSessionRequest]) -> list[tuple]:
    out = []
    for op in ops:
        kind = op.WhichOneof("op")
        if kind == "append":
            out.append(("append", op.append.start_position, list(op.append.tokens), op.append.capture.start_position))
        elif kind == "truncate":
            out.append(("truncate", op.truncate.length))
        else:
            out.append((kind,))
    return out


def test_the_rows_of_an_ar_stretch_go_as_one_append_encoded_once_with_the_round():
    encoded: list = []
    d = drafting(encoded)
    for i in range(5):  # five AR steps, one row each: nothing is encoded yet
        d.append_rows(10 + i, [100 + i], f"row{i}")
    assert encoded == [] and d.queued == []
    ops = d.round_ops(anchor=7, position=15, proposer=draft_pb2.PROPOSER_DSPARK)
    assert encoded == [(10, ["row0", "row1", "row2", "row3", "row4"])]
    assert ops_of(ops) == [("append", 10, [100, 101, 102, 103, 104], 10), ("propose",)]
    assert d.unsent is None


def test_rows_that_do_not_follow_on_and_a_rollback_keep_their_order():
    encoded: list = []
    d = drafting(encoded)
    d.append_rows(10, [1, 2], "a")
    d.append_rows(12, [3], "b")
    d.append_rows(20, [4], "c")  # not after row 12: the run before it is sent first
    d.rollback(15)  # the rows up to here reach the drafter before it truncates
    d.append_rows(15, [5], "d")
    ops = d.round_ops(anchor=7, position=16, proposer=draft_pb2.PROPOSER_DSPARK)
    assert encoded == [(10, ["a", "b"]), (20, ["c"]), (15, ["d"])]
    assert ops_of(ops) == [("append", 10, [1, 2, 3], 10), ("append", 20, [4], 20), ("truncate", 15),
                           ("append", 15, [5], 15), ("propose",)]


def test_an_append_with_its_capture_already_encoded_comes_after_the_unsent_rows():
    encoded: list = []
    d = drafting(encoded)
    d.append_rows(0, [1], "a")
    d.append(1, [2], None)  # e.g. a step without captures
    ops = d.round_ops(anchor=7, position=2, proposer=draft_pb2.PROPOSER_DSPARK)
    assert [o[:3] for o in ops_of(ops)[:-1]] == [("append", 0, [1]), ("append", 1, [2])]


def test_a_session_that_stopped_drafting_keeps_no_rows():
    encoded: list = []
    d = drafting(encoded)
    d.fail("the drafter is down")
    d.append_rows(0, [1], "a")
    assert d.unsent is None and encoded == []
