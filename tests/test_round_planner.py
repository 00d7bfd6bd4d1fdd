"""The round planner cuts a round's chains together: a fake cost table and fake confidences, no timing."""

from __future__ import annotations

import itertools
import random

import pytest
from dspark_grpc.speculation.round_planner import (
    RoundCalibration,
    draft_share,
    plan_depths,
    predicted_accepted,
    rows_beside,
)


def compute_bound(lanes: int, rows_per_lane: float) -> float:
    """A CPU-like forward: reading the weights costs 30 ms whatever the rows; each row adds 20 ms of compute."""
    return 0.030 + 0.020 * lanes * rows_per_lane


def rate_of(depths, confidences, calibration, seconds, fixed=0.0, besides=0):
    """The expected goodput of verifying depths[i] tokens of chain i beside `besides` AR sessions (a row and a token
    each), from the definition."""
    n = len(confidences) + besides
    expected = n
    for c, m in zip(confidences, depths, strict=True):
        p = 1.0
        for x in c[:m]:
            p *= x
            expected += min(1.0, calibration * p)
    return expected / (seconds(n, (n + sum(depths)) / n) + fixed)


def brute_force(confidences, min_depths, calibration, seconds, fixed=0.0, besides=0, max_draft_rows=None):
    """The best goodput over every combination of depths (the independent reference)."""
    ranges = [range(m, len(c) + 1) for c, m in zip(confidences, min_depths, strict=True)]
    return max(rate_of(depths, confidences, calibration, seconds, fixed, besides)
               for depths in itertools.product(*ranges)
               if max_draft_rows is None or sum(depths) - sum(min_depths) <= max_draft_rows)


def test_the_round_decision_flips_from_speculation_to_ar_as_sessions_grow():
    chain = [0.9, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    depths_by_sessions = {n: plan_depths([chain] * n, [0] * n, 1.0, compute_bound) for n in (1, 2, 4, 8, 16)}
    per_session = {n: sum(d) / n for n, d in depths_by_sessions.items()}
    assert per_session[1] >= 3  # alone, a row costs less than the base: verify deep
    assert per_session[1] >= per_session[2] >= per_session[4] >= per_session[8] >= per_session[16]
    assert per_session[16] == 0  # crowded: every row costs more than it is expected to give back -> AR
    assert per_session[4] < per_session[1]


def test_mode_speculation_keeps_one_token_per_session():
    chain = [0.3] * 8
    assert plan_depths([chain] * 16, [1] * 16, 1.0, compute_bound) == [1] * 16


def test_each_chain_keeps_a_prefix_and_confident_chains_get_more():
    confident, doubtful = [0.95] * 8, [0.2] * 8
    depths = plan_depths([confident, doubtful], [0, 0], 1.0, compute_bound)
    assert depths[0] > depths[1]


def test_calibration_scales_the_survival():
    chain = [0.9] * 8
    trusting = plan_depths([chain] * 4, [0] * 4, 1.0, compute_bound)
    doubting = plan_depths([chain] * 4, [0] * 4, 0.1, compute_bound)
    assert sum(doubting) < sum(trusting)


def test_a_costly_drafter_round_makes_deeper_verifies_pay():
    # 2 sessions, chains whose second tokens do not pay for their rows with a free drafter; a 200 ms round spent
    # anyway (four forwards' worth of this table) makes them pay
    chain = [0.6, 0.5, 0.5, 0.5]
    free = plan_depths([chain] * 2, [1] * 2, 1.0, compute_bound)
    paid = plan_depths([chain] * 2, [1] * 2, 1.0, compute_bound, fixed_seconds=0.2)
    assert free == [1, 1] and paid == [2, 2]
    assert rate_of(paid, [chain] * 2, 1.0, compute_bound, 0.2) > rate_of(free, [chain] * 2, 1.0, compute_bound, 0.2)


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_as_good_as_every_combination(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 3)
    confidences = [sorted((rng.random() for _ in range(rng.randint(1, 4))), reverse=rng.random() < 0.5)
                   for _ in range(n)]
    min_depths = [rng.choice([0, 1]) for _ in range(n)]
    calibration = rng.choice([0.5, 1.0, 1.5])
    fixed = rng.choice([0.0, 0.01, 0.05])
    depths = plan_depths(confidences, min_depths, calibration, compute_bound, fixed)
    assert all(m <= d <= len(c) for d, m, c in zip(depths, min_depths, confidences, strict=True))
    assert rate_of(depths, confidences, calibration, compute_bound, fixed) == pytest.approx(
        brute_force(confidences, min_depths, calibration, compute_bound, fixed), rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_beside_ar_sessions_the_plan_is_the_best_within_its_row_cap(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(1, 3)
    confidences = [sorted((rng.random() for _ in range(rng.randint(1, 4))), reverse=True) for _ in range(n)]
    besides, cap = rng.randint(1, 6), rng.randint(0, 4)
    depths = plan_depths(confidences, [0] * n, 1.0, compute_bound, 0.01, besides=besides, max_draft_rows=cap)
    assert sum(depths) <= cap
    assert rate_of(depths, confidences, 1.0, compute_bound, 0.01, besides) == pytest.approx(
        brute_force(confidences, [0] * n, 1.0, compute_bound, 0.01, besides, cap), rel=1e-9)


def test_the_rows_beside_ar_sessions_keep_their_forward_within_the_slowdown():
    # 13 sessions: 0.030 + 0.020 * 13 = 0.29 s at a row each; x 1.25 = 0.3625 s leaves 0.0725 s: 3 rows of 0.020
    assert rows_beside(13, compute_bound) == 3
    assert rows_beside(13, compute_bound, slowdown=1.0) == 0
    # alone: 0.05 s; x 1.25 leaves 0.0125 s, less than a row
    assert rows_beside(1, compute_bound) == 0
    assert rows_beside(1, compute_bound, slowdown=2.0) == 2


def test_speculating_sessions_beside_ar_ones_draft_on_a_share_of_their_steps():
    # 13 sessions stepping, 12 of them speculating, 3 draft rows a turn and a 10 ms round: a turn costs
    # 0.060 + 0.010 = 0.070 s; the budget is 0.25 x 0.29 = 0.0725 s a forward, so 0.0725 / 0.070 turns among 12
    assert draft_share(13, 12, compute_bound, 3.0, 0.010) == pytest.approx(0.0725 / 0.070 / 12)
    # one speculating session with a cheap turn may draft at every step
    assert draft_share(13, 1, compute_bound, 1.0, 0.0) == 1.0
    # what the share lets through costs (slowdown - 1) x the forward, whatever the numbers
    for lanes, speculating, rows, round_s in [(4, 3, 2.0, 0.005), (16, 15, 4.0, 0.02), (9, 1, 8.0, 0.1)]:
        share = draft_share(lanes, speculating, compute_bound, rows, round_s)
        turn = compute_bound(lanes, (lanes + rows) / lanes) - compute_bound(lanes, 1.0) + round_s
        assert share * speculating * turn <= 0.25 * compute_bound(lanes, 1.0) + 1e-12
        assert share == 1.0 or share * speculating * turn == pytest.approx(0.25 * compute_bound(lanes, 1.0))


def test_the_draft_rows_are_an_average_that_starts_at_the_first_drafting_step():
    cal = RoundCalibration(alpha=0.5)
    cal.observe_draft_rows(4)
    cal.observe_draft_rows(2)
    assert cal.draft_rows == pytest.approx(3.0)


def test_calibration_is_a_ratio_of_means():
    cal = RoundCalibration(alpha=0.5)
    for _ in range(30):
        cal.observe(predicted=4.0, accepted=1)
    assert cal.value == pytest.approx(0.25, rel=1e-3)
    assert predicted_accepted([0.5, 0.5, 0.5], 2) == pytest.approx(0.5 + 0.25)


def test_the_round_seconds_are_an_average_that_starts_at_the_first_round():
    cal = RoundCalibration(alpha=0.5)
    assert cal.round_seconds == 0.0
    cal.observe_round(0.004)
    assert cal.round_seconds == pytest.approx(0.004)
    cal.observe_round(0.002)
    assert cal.round_seconds == pytest.approx(0.003)
