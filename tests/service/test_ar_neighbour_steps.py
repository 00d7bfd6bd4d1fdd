"""A speculating session beside an AR one drafts on its turns and steps AR on the others, and its output stays AR's:
the real engine (the embedded SmolLM2, fast precision) without gRPC, the oracle drafter of test_chain_ahead_steps,
the share of turns fixed at one in two and the neighbourhood's memory made endless (no clock decides)."""

from __future__ import annotations

from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2
from dspark_grpc.serving.sessions import Owner
from dspark_grpc.target_service import step_engine

from tests.service.test_chain_ahead_steps import A_TOKEN_A_STEP, PROMPT, ar_continuation, oracle_servicer, run


def test_beside_an_ar_session_a_speculating_one_drafts_on_its_turns_and_its_output_is_ars(fast_engine, monkeypatch):
    engine = fast_engine
    ar, greedy = ar_continuation(engine)
    monkeypatch.setattr(step_engine, "NEIGHBOURS_MEMORY_S", 1e9)
    monkeypatch.setattr(step_engine, "draft_share", lambda *args: 0.5)
    engine.cost_tables = A_TOKEN_A_STEP
    servicer, _, drafter = oracle_servicer(engine, greedy)
    neighbour = Owner("neighbour")
    opened = servicer.handle(target_pb2.TargetSessionRequest(request_id=1, open=target_pb2.OpenSession()), neighbour)
    neighbour_id = opened.opened.session_id
    prefilled = servicer.handle(target_pb2.TargetSessionRequest(
        request_id=2, prefill=target_pb2.Prefill(session_id=neighbour_id, prompt=PROMPT)), neighbour)
    assert prefilled.status.code == 0, prefilled.status.message  # an AR session that has just stepped
    try:
        spec, reports, _, _ = run(servicer, common_pb2.DECODE_MODE_SPECULATION)
    finally:
        engine.cost_tables = []
        drafter.rounds.close()
        servicer.steps.release_owner(neighbour)
    assert spec[: len(ar)] == ar
    # its credit starts at 0 and grows by 1/2 a step: AR (its turn waited for), then a draft, and so on
    drafted = [r.draft_depth > 0 for r in reports]
    assert drafted == [i % 2 == 1 for i in range(len(reports))], drafted
    assert all(r.planned_ar and r.draft_seconds == 0 for r, d in zip(reports, drafted, strict=True) if not d)
    # the first report says why, once
    assert "drafting on 50% of its steps while 1 AR session(s)" in reports[0].fallback_reason
    assert not any("drafting on" in r.fallback_reason for r in reports[1:])
