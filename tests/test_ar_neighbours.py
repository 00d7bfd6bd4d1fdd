"""Speculating sessions beside AR ones take turns to draft (issue 37, point 4): the step engine's plan with a fake
cost table, sessions placed by hand and the neighbourhood's memory made endless (no clock in the decision)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.speculation.cost_table import CostKey, CostTable
from dspark_grpc.speculation.mode_chooser import AR, SPECULATE, ModeChooser
from dspark_grpc.target_service import step_engine
from dspark_grpc.target_service.step_engine import ServedSession, StepEngine
from dspark_grpc.target_service.steps import SessionDrafting

DSPARK = draft_pb2.PROPOSER_DSPARK


def speculating(sid: str, mode: int = common_pb2.DECODE_MODE_SPECULATION) -> SessionDrafting:
    options = target_pb2.StepOptions(mode=mode, proposer=DSPARK)
    return SessionDrafting(sid, options, draft_pb2.GetDrafterInfoResponse(default_proposer=DSPARK))


def engine_with(ar: int, spec: int, ended_s_ago: float = 0.0) -> tuple[StepEngine, list[SessionDrafting]]:
    """A step engine whose last steps were `ar` AR sessions' and `spec` speculating ones', with a table of a
    CPU-like forward at 13 lanes: 0.030 s + 0.020 s a row (0.29 s at a row each, 0.55 s at two)."""
    steps = StepEngine()
    steps.engine = SimpleNamespace(cost_tables=[CostTable(CostKey("verify", "test", lanes=13), [1, 2], [0.29, 0.55])])
    ended = (time.perf_counter() - ended_s_ago, AR, 0)
    for i in range(ar):
        steps.served[f"ar{i}"] = ServedSession(step_ended=ended)
    sessions = [speculating(f"spec{i}") for i in range(spec)]
    for d in sessions:
        steps.served[d.session_id] = ServedSession(step_ended=(ended[0], SPECULATE, 0), drafting=d)
    steps.round_calibration.draft_rows, steps.round_calibration.round_seconds = 3.0, 0.010
    return steps, sessions


@pytest.fixture(autouse=True)
def endless_memory(monkeypatch):
    monkeypatch.setattr(step_engine, "NEIGHBOURS_MEMORY_S", 1e9)


def test_without_ar_neighbours_a_session_drafts_at_every_step():
    steps, sessions = engine_with(ar=0, spec=12)
    assert all(steps._arm(sessions[0], 12).arm == DSPARK for _ in range(50))


def test_beside_an_ar_session_twelve_speculating_sessions_draft_on_their_share_of_steps():
    steps, sessions = engine_with(ar=1, spec=12)
    # by hand: the budget is 0.25 x 0.29 s a forward; a turn costs 3 rows (0.06 s) and a 10 ms round
    share = 0.25 * 0.29 / (12 * (0.06 + 0.010))
    plans = [[steps._arm(d, 13) for _ in range(120)] for d in sessions]
    for session_plans in plans:
        turns = sum(p.arm == DSPARK for p in session_plans)
        assert int(120 * share) <= turns <= int(120 * share) + 1
        assert all(p.waits_turn for p in session_plans if p.arm == AR)
    assert all(len(d.notes) == 1 and "drafting on 9% of its steps while 1 AR session(s)" in d.notes[0]
               for d in sessions)
    # the sessions take their turns at different steps, not all at once
    at_step = [sum(p[i].arm == DSPARK for p in plans) for i in range(120)]
    assert max(at_step) <= 3


def test_an_adaptive_session_counts_as_speculating_or_not_at_all_and_a_failed_drafter_as_ar():
    steps, sessions = engine_with(ar=0, spec=3)
    adaptive = speculating("adaptive", common_pb2.DECODE_MODE_ADAPTIVE)
    adaptive.chooser, adaptive.last_arm = ModeChooser(), AR
    steps.served["adaptive"] = ServedSession(step_ended=(time.perf_counter(), AR, 0), drafting=adaptive)
    assert steps._neighbourhood() == (0, 3)  # AR by the adaptive mode's choice: not a request for AR
    adaptive.last_arm = SPECULATE
    assert steps._neighbourhood() == (0, 4)
    sessions[0].fail("drafter open failed")
    assert steps._neighbourhood() == (1, 3)  # target-only now: it steps AR


def test_sessions_that_have_not_stepped_lately_are_not_neighbours(monkeypatch):
    monkeypatch.setattr(step_engine, "NEIGHBOURS_MEMORY_S", 1.0)
    steps, sessions = engine_with(ar=4, spec=2, ended_s_ago=3600.0)
    assert steps._neighbourhood() == (0, 1)  # (a session that plans counts itself)
    assert all(steps._arm(sessions[0], 2).arm == DSPARK for _ in range(20))


def test_without_cost_tables_nothing_waits_its_turn():
    steps, sessions = engine_with(ar=4, spec=2)
    steps.engine.cost_tables = []
    assert all(steps._arm(sessions[0], 6).arm == DSPARK for _ in range(20))


def test_the_bound_is_the_targets_to_set_or_turn_off():
    steps, sessions = engine_with(ar=1, spec=12)
    steps.ar_neighbour_slowdown = None  # dspark-target serve --ar-neighbour-slowdown 0
    assert all(steps._arm(sessions[0], 13).arm == DSPARK for _ in range(50))
    steps.ar_neighbour_slowdown = 1.5  # twice the budget of the default's: twice the turns (by hand as above)
    share = 0.5 * 0.29 / (12 * (0.06 + 0.010))
    turns = sum(steps._arm(sessions[1], 13).arm == DSPARK for _ in range(120))
    assert int(120 * share) <= turns <= int(120 * share) + 1
