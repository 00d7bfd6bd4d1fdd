"""The Step op's rules on a session that drafts with the target's drafter (the random drafter, greedy)."""

from __future__ import annotations

import urllib.request

import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2

from tests.service.conftest import RawSession

SPECULATION = target_pb2.StepOptions(mode=common_pb2.DECODE_MODE_SPECULATION)
PROMPT = common_pb2.Prompt(text="The capital of France is")


@pytest.fixture()
def session(spec_target_address):
    raw = RawSession(spec_target_address)
    yield raw
    raw.close()


def test_a_budget_over_the_targets_tree_limit_is_refused_at_open(session):
    options = target_pb2.StepOptions(mode=common_pb2.DECODE_MODE_SPECULATION, proposal=draft_pb2.PROPOSAL_KIND_TREE,
                                     budget=100_000)
    response = session.call(open=target_pb2.OpenSession(step_options=options))
    assert response.status.code == 3 and "--max-tree-nodes" in response.status.message


def test_verify_and_commit_are_refused_on_a_drafting_session(session):
    sid = session.ok(open=target_pb2.OpenSession(step_options=SPECULATION)).session_id
    pending = session.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=PROMPT)).next_token
    response = session.call(verify=target_pb2.Verify(session_id=sid, tree=common_pb2.TokenTree(
        tokens=[pending], parents=[-1]), commit=True))
    assert response.status.code == 9 and "send Step" in response.status.message
    response = session.call(commit=target_pb2.Commit(session_id=sid, path=[0], next_token=pending))
    assert response.status.code == 9


def test_a_rollback_keeps_the_session_drafting_and_replays_the_same_tokens(session, spec_target_address):
    sid = session.ok(open=target_pb2.OpenSession(step_options=SPECULATION)).session_id
    pre = session.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=PROMPT))
    tokens, start = [pre.next_token], len(pre.prompt_tokens)
    for _ in range(3):
        stepped = session.ok(step=target_pb2.Step(session_id=sid))
        tokens += [*stepped.tokens[1:], stepped.next_token]
    session.ok(rollback=target_pb2.Rollback(session_id=sid, length=start + 1))  # keep the first generated token
    replayed = tokens[:2]
    while len(replayed) < len(tokens):
        stepped = session.ok(step=target_pb2.Step(session_id=sid))
        assert stepped.report.draft_depth >= 1 and stepped.report.fallback_reason == "", stepped.report
        replayed += [*stepped.tokens[1:], stepped.next_token]
    assert replayed[: len(tokens)] == tokens
    with TargetClient(spec_target_address) as client:  # and the tokens are AR's
        ar = client.generate(PROMPT.text, max_new_tokens=len(tokens), mode="ar", ignore_eos=True).token_ids
    assert ar == tokens[: len(ar)]


def draft_ahead_count(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=60).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dspark:draft_ahead_total{"))


def test_tokens_left_bounds_the_draft_and_the_draft_ahead(session, spec_target):
    """A step that may emit k more tokens verifies a draft of depth <= k - 1; once a step emits what the caller
    said it will take, the target drafts nothing ahead for a step that will not come."""
    _, metrics_url = spec_target
    sid = session.ok(open=target_pb2.OpenSession(step_options=SPECULATION)).session_id
    session.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=PROMPT))
    assert session.ok(step=target_pb2.Step(session_id=sid)).report.draft_depth >= 2  # unbounded: the chain
    for left in (2, 1):
        report = session.ok(step=target_pb2.Step(session_id=sid, tokens_left=left)).report
        assert report.draft_depth == left - 1, (left, report)
        if left == 2:  # it emitted one token (the random drafter is never right): one may follow, nothing to draft
            before = draft_ahead_count(metrics_url)
    assert draft_ahead_count(metrics_url) == before  # the step of 1 was not drafted ahead
    # the bounded step of 1 ended the request
    before = draft_ahead_count(metrics_url)
    session.ok(step=target_pb2.Step(session_id=sid))
    assert draft_ahead_count(metrics_url) == before  # that step was drafted when it came, not ahead
    response = session.call(step=target_pb2.Step(session_id=sid, tokens_left=-1))
    assert response.status.code == 3 and "tokens_left" in response.status.message


def test_an_adaptive_step_that_can_emit_one_token_is_planned_ar(session):
    """Nothing can be drafted for it, whatever the target's chooser would say: it is an AR step by plan, not a
    speculative step that fell back (tests/service/test_fail_closed.py counts on that)."""
    sid = session.ok(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(
        mode=common_pb2.DECODE_MODE_ADAPTIVE))).session_id
    session.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=PROMPT))
    report = session.ok(step=target_pb2.Step(session_id=sid, tokens_left=1)).report
    assert report.planned_ar and report.draft_depth == 0 and report.draft_seconds == 0


def test_the_step_report_splits_the_drafter_round_into_its_phases(session):
    """Every step whose proposal came from a round (asked for within the step or ahead) reports the round's phases,
    each a duration measured within the one before it (no clock comparison across processes): the proposal's
    compute inside the draft service's time on the round, inside the round as the target timed it. A step asked
    for within the step waited at least its round."""
    sid = session.ok(open=target_pb2.OpenSession(step_options=SPECULATION)).session_id
    session.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=PROMPT))
    reports = [session.ok(step=target_pb2.Step(session_id=sid)).report for _ in range(6)]
    # the first step asks for its proposal; the ones after it were asked for ahead (the random drafter's chains are
    # rejected: none verifies the rest of a chain), and report their rounds all the same
    assert all(r.draft_depth >= 1 and not r.draft_from_chain for r in reports), reports
    for r in reports:
        assert 0 < r.draft_compute_seconds <= r.round_drafter_seconds <= r.round_seconds, r
    assert reports[0].round_seconds <= reports[0].draft_seconds
