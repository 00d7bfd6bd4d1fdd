"""The adaptive planner on synthetic steps (no services, no clock): arm choice from cost tables and measured
acceptance, probing, the confidence cut, memory across requests, and the torch-free cost lookup."""

from __future__ import annotations

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2
from dspark_grpc.speculation.planner import AR, PlannerMemory, StepPlanner, VerifyCosts

DSPARK, NGRAM = draft_pb2.PROPOSER_DSPARK, draft_pb2.PROPOSER_NGRAM
# A CPU-like target: 1 row 50 ms, more rows cost more; 8 sessions x 1 row 90 ms.
TABLES = [common_pb2.CostTable(lanes=1, sizes=[1, 2, 4, 8, 16], seconds=[0.050, 0.070, 0.072, 0.075, 0.090]),
          common_pb2.CostTable(lanes=8, sizes=[1, 2, 4, 8, 16], seconds=[0.090, 0.110, 0.150, 0.220, 0.350])]


def simulate(planner: StepPlanner, steps: int, accepted: dict[int, int], draft_s: dict[int, float],
             rows: dict[int, int], lanes: int = 1) -> list[int]:
    """Run `steps` planner steps where arm a always gets accepted[a] tokens from rows[a] verified rows."""
    costs = VerifyCosts(TABLES)
    chosen = []
    for step in range(1, steps + 1):
        arm = planner.choose(step)
        chosen.append(arm)
        r = 1 if arm == AR else rows[arm]
        verify = costs.seconds(lanes, r)
        d = 0.0 if arm == AR else draft_s[arm]
        planner.observe(arm, r, 0 if arm == AR else accepted[arm], d, d + verify, verify, lanes, lanes * r)
    return chosen


def test_cost_lookup_interpolates_rows_and_lanes():
    costs = VerifyCosts(TABLES)
    assert costs.seconds(1, 1) == pytest.approx(0.050)
    assert costs.seconds(1, 3) == pytest.approx(0.071)
    assert costs.seconds(8, 4) == pytest.approx(0.150)
    # halfway in lanes between the 1- and 8-lane tables
    assert costs.seconds(4.5, 1) == pytest.approx((0.050 + 0.090) / 2)
    assert not VerifyCosts([])


def test_a_drafter_that_is_never_right_is_dropped_after_one_try_and_probed_ever_more_rarely():
    planner = StepPlanner([DSPARK], VerifyCosts(TABLES), probe_every=8)
    chosen = simulate(planner, 400, accepted={DSPARK: 0}, draft_s={DSPARK: 0.025}, rows={DSPARK: 8})
    assert chosen[0] == DSPARK and chosen[1] == AR
    probes = [i for i, a in enumerate(chosen) if a == DSPARK]
    assert len(probes) <= 1 + 6  # 8, 16, 32, 64, 128, 256-step intervals
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps)
    assert planner.switches and "AR" in planner.switches[0]


def test_noise_that_makes_wide_verifies_look_cheaper_than_ar_does_not_keep_a_drafter_that_is_never_right():
    # Measured forwards (the fake clock below) say 1 row takes 2x the table and 8 rows 0.5x: on a busy machine a
    # 1-row step that met a stall. A drafter that never gets a token accepted must still lose to AR.
    table = VerifyCosts(TABLES)

    def measured(rows: int) -> float:
        return table.seconds(1, rows) * (2.0 if rows == 1 else 0.5)

    planner = StepPlanner([DSPARK], table, probe_every=8)
    chosen = []
    for step in range(1, 201):
        arm = planner.choose(step)
        chosen.append(arm)
        rows, d = (8, 0.012) if arm == DSPARK else (1, 0.0)
        planner.observe(arm, rows, 0, d, d + measured(rows), measured(rows), 1, rows)
    assert planner.stats[DSPARK].relative_cost >= 1.0
    assert chosen.count(DSPARK) <= 1 + 5  # the first try, then probes at 8, 16, 32, 64, 128-step intervals
    assert chosen[-20:].count(AR) >= 19


def test_a_drafter_that_pays_keeps_being_used():
    # 3 of 8 draft tokens accepted: 4 tokens per 75 + 5 ms vs 1 per 50 ms
    planner = StepPlanner([DSPARK], VerifyCosts(TABLES))
    chosen = simulate(planner, 100, accepted={DSPARK: 3}, draft_s={DSPARK: 0.005}, rows={DSPARK: 8})
    assert chosen.count(DSPARK) == 100


def test_under_load_a_weak_drafter_stops_paying_and_a_strong_one_does_not():
    # 8 sessions x 8 rows: 220 ms; x 1 row: 90 ms. One accepted token per step: 8 * 2 / 0.225 s < 8 / 0.09 s
    weak = StepPlanner([DSPARK], VerifyCosts(TABLES))
    chosen = simulate(weak, 60, accepted={DSPARK: 1}, draft_s={DSPARK: 0.005}, rows={DSPARK: 8}, lanes=8)
    assert chosen.count(AR) >= 50
    alone = StepPlanner([DSPARK], VerifyCosts(TABLES))  # the same drafter pays for a lone session
    chosen = simulate(alone, 60, accepted={DSPARK: 1}, draft_s={DSPARK: 0.005}, rows={DSPARK: 8}, lanes=1)
    assert chosen.count(DSPARK) == 60
    strong = StepPlanner([DSPARK], VerifyCosts(TABLES))  # three accepted: 8 * 4 / 0.225 s > 8 / 0.09 s
    chosen = simulate(strong, 60, accepted={DSPARK: 3}, draft_s={DSPARK: 0.005}, rows={DSPARK: 8}, lanes=8)
    assert chosen.count(DSPARK) == 60


def test_the_better_of_two_proposers_wins():
    planner = StepPlanner([DSPARK, NGRAM], VerifyCosts(TABLES))
    chosen = simulate(planner, 200, accepted={DSPARK: 0, NGRAM: 2}, draft_s={DSPARK: 0.025, NGRAM: 0.002},
                      rows={DSPARK: 8, NGRAM: 4})
    assert chosen[:2] == [DSPARK, NGRAM]
    assert chosen[2:].count(NGRAM) >= 190


def test_without_cost_tables_it_compares_measured_step_times():
    planner = StepPlanner([NGRAM], None)
    chosen = simulate(planner, 50, accepted={NGRAM: 1}, draft_s={NGRAM: 0.002}, rows={NGRAM: 3})
    assert chosen[0] == NGRAM and chosen[1] == AR  # try it, then measure AR once
    assert chosen[2:].count(NGRAM) >= 45  # 2 tokens / 73 ms beats 1 / 50 ms


def brute_force_cut(planner: StepPlanner, confidences: list[float]) -> int:
    """The best depth by enumerating every cut, written independently of cut_chain."""
    values = []
    for m in range(len(confidences) + 1):
        expected, survival = 0.0, 1.0
        for c in confidences[:m]:
            survival *= c
            expected += min(1.0, planner.calibration * survival)
        values.append((1 + expected) / planner.forward_seconds(1 + m))
    return max(range(len(values)), key=lambda m: (values[m], -m))


@pytest.mark.parametrize("confidences", [[0.9, 0.8, 0.7, 0.2, 0.1], [0.1, 0.9, 0.9], [0.99] * 7, [0.5, 0.5]])
def test_confidence_cut_is_the_best_prefix(confidences):
    planner = StepPlanner([DSPARK], VerifyCosts(TABLES))
    assert planner.cut_chain(confidences) == brute_force_cut(planner, confidences)
    planner.calibration = 0.05  # a drafter whose confidences have been far too high: verify nothing
    assert planner.cut_chain(confidences) == 0


def test_memory_carries_estimates_to_the_next_request():
    memory = PlannerMemory()
    first = StepPlanner([DSPARK], VerifyCosts(TABLES), memory)
    simulate(first, 10, accepted={DSPARK: 0}, draft_s={DSPARK: 0.025}, rows={DSPARK: 8})
    first.finish()
    second = StepPlanner([DSPARK], VerifyCosts(TABLES), memory)
    assert second.choose(1) == AR  # no new first try: it already knows the drafter does not pay


def test_arms_must_be_proposers():
    with pytest.raises(ValueError):
        StepPlanner([AR], None)
    with pytest.raises(ValueError):
        StepPlanner([], None)


def test_prompt_lookup_that_matches_one_step_in_eight_is_priced_by_its_mean_cost_and_kept():
    # no match: a 1-row step (50 ms); a match: 9 rows (76 ms) with 3 accepted. Mean 1.375 tokens per 53 ms beats
    # AR's 1 per 50 ms; pricing the mean rows (2) instead would say 1.375 per 70 ms and lose.
    costs = VerifyCosts(TABLES)
    planner = StepPlanner([NGRAM], costs)
    chosen = []
    for step in range(1, 161):
        arm = planner.choose(step)
        chosen.append(arm)
        match = arm == NGRAM and step % 8 == 0
        rows, acc = (9, 3) if match else (1, 0)
        verify = costs.seconds(1, rows)
        d = 0.001 if arm == NGRAM else 0.0
        planner.observe(arm, rows, acc, d, d + verify, verify, 1, rows)
    assert chosen[16:].count(NGRAM) >= 130


def test_a_table_wrong_only_for_wide_verifies_is_corrected_per_shape():
    # The table says 8 rows cost 75 ms (1.5 AR steps); really they cost 150 ms (3 steps, e.g. a table profiled on
    # a busy machine), while 1 row really costs the table's 50 ms. One accepted token per 8-row step + 5 ms of
    # drafting: the table promises 2 tokens / 80 ms (25/s) vs AR's 20/s; the truth is 2 / 155 ms (12.9/s).
    table = VerifyCosts(TABLES)

    def real(rows: int) -> float:
        return 0.150 if rows >= 8 else table.seconds(1, rows)

    memory = PlannerMemory()
    planner = StepPlanner([DSPARK], table, memory)
    chosen = []
    for step in range(1, 41):
        arm = planner.choose(step)
        chosen.append(arm)
        rows, acc, d = (8, 1, 0.005) if arm == DSPARK else (1, 0, 0.0)
        planner.observe(arm, rows, acc, d, d + real(rows), real(rows), 1, rows)
    assert planner.speed_for(8) == pytest.approx(2.0) and planner.speed_for(1) == pytest.approx(1.0)
    assert planner.forward_seconds(8) == pytest.approx(0.150)
    assert chosen[0] == DSPARK and chosen[-10:] == [AR] * 10  # after a probe or two it settles on AR
    assert planner.rate(DSPARK) == pytest.approx(2 / 0.155, rel=0.05)
    # a single scale factor for every shape could not tell: it scales AR and the 8-row verify alike
    planner.finish()
    assert StepPlanner([DSPARK], table, memory).speed_for(8) == pytest.approx(2.0)  # remembered


@pytest.mark.parametrize("truth", [1.0, 0.5])
def test_calibration_recovers_how_often_confident_drafts_are_right(truth):
    # A one-token draft with confidence c is accepted with probability truth * c (Bernoulli, seeded). Most steps
    # accept nothing, so an average of per-step accepted/predicted ratios would drift towards zero; the planner's
    # calibration must find `truth`.
    import random

    rng = random.Random(0)
    planner = StepPlanner([DSPARK], VerifyCosts(TABLES), alpha=0.02)
    values = []
    for step in range(4000):
        c = rng.choice([0.2, 0.35, 0.5])
        accepted = int(rng.random() < truth * c)
        planner.observe(DSPARK, 2, accepted, 0.001, 0.05, 0.05, 1, 2, predicted_accepted=c)
        if step >= 1000:
            values.append(planner.calibration)
    mean = sum(values) / len(values)
    assert abs(mean - truth) < 0.12 * truth, mean


def test_adaptive_arms_take_prompt_lookup_beside_dspark_but_not_beside_hybrid():
    from dspark_grpc.speculation.steps import planner_arms

    def arms(default: int, asked: int = draft_pb2.PROPOSER_UNSPECIFIED) -> list[int]:
        info = draft_pb2.GetDrafterInfoResponse(default_proposer=default, proposers=[
            draft_pb2.PROPOSER_DSPARK, draft_pb2.PROPOSER_NGRAM, draft_pb2.PROPOSER_HYBRID])
        return planner_arms(asked, info)

    assert arms(draft_pb2.PROPOSER_DSPARK) == [DSPARK, NGRAM]
    assert arms(draft_pb2.PROPOSER_HYBRID) == [draft_pb2.PROPOSER_HYBRID]  # hybrid already follows n-gram matches
    assert arms(draft_pb2.PROPOSER_HYBRID, asked=NGRAM) == [NGRAM]
