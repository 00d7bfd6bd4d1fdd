"""The round planner cuts a round's chains together: a fake cost table and fake confidences, no timing."""

from __future__ import annotations

import itertools
import random

import pytest
from dspark_grpc.speculation.round_planner import RoundCalibration, plan_depths, predicted_accepted


def compute_bound(lanes: int, rows_per_lane: float) -> float:
    """A CPU-like forward: reading the weights costs 30 ms whatever the rows; each row adds 20 ms of compute."""
    return 0.030 + 0.020 * lanes * rows_per_lane


def rate_of(depths, confidences, calibration, seconds, fixed=0.0):
    """The expected goodput of verifying depths[i] tokens of chain i, from the definition."""
    n = len(confidences)
    expected = n
    for c, m in zip(confidences, depths, strict=True):
        p = 1.0
        for x in c[:m]:
            p *= x
            expected += min(1.0, calibration * p)
    return expected / (seconds(n, (n + sum(depths)) / n) + fixed)


def brute_force(confidences, min_depths, calibration, seconds, fixed=0.0):
    """The best goodput over every combination of depths (the independent reference)."""
    ranges = [range(m, len(c) + 1) for c, m in zip(confidences, min_depths, strict=True)]
    return max(rate_of(depths, confidences, calibration, seconds, fixed) for depths in itertools.product(*ranges))


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
