"""The adaptive mode's chooser on synthetic steps: a fake cost table and fake acceptance, no clock (the seconds
each step waited are computed from the table and handed in)."""

from __future__ import annotations

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.speculation.cost_table import VerifyCosts
from dspark_grpc.speculation.mode_chooser import AR, SPECULATE, ModeChooser, load_bucket

# A CPU-like target: one session's forward costs little more for 4 rows than for 1; eight sessions' forwards are
# compute-bound, so every row costs.
TABLES = [common_pb2.CostTable(lanes=1, sizes=[1, 2, 4, 8], seconds=[0.050, 0.052, 0.056, 0.064]),
          common_pb2.CostTable(lanes=8, sizes=[1, 2, 4, 8], seconds=[0.100, 0.140, 0.260, 0.500])]
COSTS = VerifyCosts(TABLES)
ROWS, DRAFT_SECONDS = 4, 0.004


def step_seconds(arm: int, load: int, busy: float = 1.0) -> float:
    """What a session waits for one step in the fake system (one forward of `load` sessions, plus the drafter)."""
    if arm == AR:
        return COSTS.seconds(load, 1) * busy
    return COSTS.seconds(load, ROWS) * busy + DRAFT_SECONDS


def run(chooser: ModeChooser, load: int, steps: int, accepted: int, busy: float = 1.0) -> tuple[list[int], float]:
    """`steps` steps at `load`: the arms chosen and the goodput reached (tokens per second per session)."""
    arms, tokens, seconds = [], 0, 0.0
    for _ in range(steps):
        arm = chooser.choose(load)
        got = 1 + (accepted if arm == SPECULATE else 0)
        waited = step_seconds(arm, load, busy)
        chooser.observe(arm, load, got, waited, accepted if arm == SPECULATE else 0, ROWS, DRAFT_SECONDS)
        arms.append(arm)
        tokens, seconds = tokens + got, seconds + waited
    return arms, tokens / seconds


def best_goodput(load: int, accepted: int, busy: float = 1.0) -> float:
    return max(1 / step_seconds(AR, load, busy), (1 + accepted) / step_seconds(SPECULATE, load, busy))


def test_load_buckets():
    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 1, 2, 3, 4, 8, 8, 16, 16, 32]


def test_the_prediction_flips_from_speculation_to_ar_as_sessions_grow():
    chooser = ModeChooser(COSTS)
    assert chooser.predicted_speedup(1) is None  # nothing measured: no prediction
    chooser.observe(SPECULATE, 1, 2, 0.06, accepted=1, rows=ROWS, draft_seconds=DRAFT_SECONDS)
    # one accepted token per step, 4 rows: alone 2 tokens for 0.060 s against 1 for 0.050 s; among 8, 2 tokens
    # for 0.264 s against 1 for 0.100 s
    assert chooser.predicted_speedup(1) == pytest.approx(2 * 0.050 / 0.060)
    assert chooser.predicted_speedup(8) == pytest.approx(2 * 0.100 / 0.264)
    assert chooser.choose(1) == SPECULATE
    assert chooser.choose(8) == AR  # a load never measured starts where the cost table says
    assert chooser.buckets[8].interval == chooser.max_interval  # a clear loser there (0.76x): probed rarely


@pytest.mark.parametrize("load", [1, 8])
def test_measured_goodput_decides_and_holds_the_bar(load):
    chooser = ModeChooser()  # no cost table: it measures both arms
    arms, goodput = run(chooser, load, 2000, accepted=1)
    better = SPECULATE if load == 1 else AR
    assert chooser.buckets[load].best == better
    assert arms.count(better) / len(arms) > 0.9
    assert goodput >= 0.97 * best_goodput(load, accepted=1)


def test_a_drafter_that_is_never_right_is_probed_less_and_less():
    chooser = ModeChooser()
    arms, goodput = run(chooser, 1, 3000, accepted=0)
    assert goodput >= 0.95 * best_goodput(1, accepted=0)
    probes = [i for i in range(1, len(arms)) if arms[i] == SPECULATE and arms[i - 1] == AR]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 32 * chooser.window_tokens(1)  # backing off up to max_interval


def test_a_clear_loser_backs_off_further_than_a_close_one():
    """Probes cost in proportion to how much the probed arm loses: one that loses by far (here speculation at half
    AR's goodput) is probed up to every 4 x max_interval windows, one about as fast every max_interval."""
    intervals = {}
    for name, spec_seconds in (("far", 0.1), ("close", 0.052)):
        chooser = ModeChooser()
        for _ in range(20000):
            arm = chooser.choose(2)
            chooser.observe(arm, 2, 1, 0.05 if arm == AR else spec_seconds)  # AR: 1 token in 50 ms
        assert chooser.buckets[2].best == AR
        intervals[name] = chooser.buckets[2].interval
    assert intervals == {"far": 4 * ModeChooser().max_interval, "close": ModeChooser().max_interval}


def test_a_busier_machine_flips_the_choice_when_speculation_stops_paying():
    """Speculating is worth it at load 2 until the machine gets slower for the target's forwards than the table
    says (another process on the cores): the chooser follows what it measures, not the table."""
    chooser = ModeChooser(COSTS)
    run(chooser, 2, 500, accepted=1)
    assert chooser.choose(2) == SPECULATE
    # speculation now accepts nothing: its steps only cost
    arms, goodput = run(chooser, 2, 2000, accepted=0, busy=1.5)
    assert chooser.buckets[2].best == AR and arms[-500:].count(AR) > 450
    assert chooser.summary()[2]["ar"] > chooser.summary()[2]["speculation"]


def test_loads_keep_their_own_estimates():
    chooser = ModeChooser()
    run(chooser, 1, 500, accepted=1)
    run(chooser, 8, 1000, accepted=1)
    assert chooser.choose(1) == SPECULATE and chooser.choose(8) == AR
    assert "measured" in chooser.reason(8) and chooser.reason(8).startswith("AR at 8 sessions")


def test_steps_planned_before_a_switch_are_samples_but_do_not_count_in_the_window():
    chooser = ModeChooser(min_window=4, window_per_session=1)
    assert chooser.choose(1) == SPECULATE  # first try
    chooser.observe(AR, 1, 1, 0.05)  # an AR step planned earlier
    assert chooser.buckets[1].window_left == 4 and chooser.buckets[1].rates[AR].steps == 1
    for _ in range(2):  # a window of 4 tokens
        chooser.observe(SPECULATE, 1, 2, 0.06, 1, ROWS)
    assert chooser.buckets[1].rates[AR].steps == 1
    assert chooser.choose(1) == SPECULATE  # AR measured already (1/0.05 < 2/0.06): no probe needed yet


def test_a_new_load_starts_from_its_neighbours():
    chooser = ModeChooser()
    run(chooser, 8, 1000, accepted=1)
    assert chooser.buckets[8].best == AR
    assert chooser.choose(16) == AR  # AR already wins at fewer sessions: no speculative first window at 16
    assert chooser.reason(16) == "AR at 16 sessions (AR measured better at 8 sessions)"
    assert chooser.buckets[16].interval == chooser.max_interval  # and probed as rarely as a clear loser
    run(chooser, 1, 500, accepted=1)
    assert chooser.choose(2) == SPECULATE and chooser.buckets[2].best is None  # 1 speculates, 8 does not: measure


def test_steps_of_other_modes_measure_a_load_before_an_adaptive_session_runs_there():
    chooser = ModeChooser(COSTS)
    for _ in range(50):  # sessions of modes AR and speculation at load 4: both arms measured, no window run
        chooser.observe(AR, 4, 1, 0.05)
        chooser.observe(SPECULATE, 4, 2, 0.12, accepted=1, rows=ROWS)
    assert chooser.buckets[4].arm is None
    assert chooser.choose(4) == AR  # 16.7 tokens/s speculating against 20 for AR
    assert chooser.buckets[4].best == AR and "measured 0.83x" in chooser.reason(4)


def test_the_load_ignores_the_dip_between_one_request_and_the_next():
    chooser = ModeChooser(load_memory_s=1.0)
    assert chooser.load(4, now=10.0) == 4
    assert chooser.load(3, now=10.2) == 4  # one request ended, the next not opened yet
    assert chooser.load(4, now=10.3) == 4
    assert chooser.load(2, now=11.0) == 4
    assert chooser.load(2, now=11.4) == 2  # the tail of a run: the load fell for longer than a second


def test_a_clear_loser_measured_by_other_sessions_is_probed_rarely():
    chooser = ModeChooser()
    for _ in range(50):
        chooser.observe(AR, 8, 1, 0.05)
        chooser.observe(SPECULATE, 8, 1, 0.10)  # half AR's goodput
        chooser.observe(AR, 2, 1, 0.05)
        chooser.observe(SPECULATE, 2, 1, 0.055)  # about as fast: probed at the usual interval
    assert chooser.choose(8) == AR and chooser.buckets[8].interval == chooser.max_interval
    assert chooser.choose(2) == AR and chooser.buckets[2].interval == chooser.min_interval


def test_the_first_probe_of_a_clear_loser_comes_after_max_interval_windows():
    """At high load a probe switches every session of the forward: the first one waits as long as the interval
    allows before backing off further."""
    chooser = ModeChooser()
    for _ in range(50):  # other sessions measured both arms at load 8: speculation at half AR's goodput
        chooser.observe(AR, 8, 1, 0.05)
        chooser.observe(SPECULATE, 8, 1, 0.10)
    ar_tokens = 0
    while chooser.choose(8) == AR:
        chooser.observe(AR, 8, 1, 0.05)
        ar_tokens += 1
    assert ar_tokens == chooser.max_interval * chooser.window_tokens(8)


@pytest.mark.parametrize(("spec_seconds", "windows"), [(0.10, 32), (0.052, 4)])
def test_a_first_try_that_the_ar_probe_beats_by_far_waits_max_interval(spec_seconds, windows):
    """A bucket with nothing to go by speculates first, then probes AR. If AR wins by far (speculation at half its
    goodput), speculation is next tried after max_interval windows of AR; if it wins narrowly, after min_interval."""
    chooser = ModeChooser()
    steps = {AR: 0, SPECULATE: 0}
    arms = []
    while len(arms) < 200 * chooser.window_tokens(1):
        arm = chooser.choose(1)
        chooser.observe(arm, 1, 1, 0.05 if arm == AR else spec_seconds)  # one token per step in either arm
        steps[arm] += 1
        arms.append(arm)
    first_try = arms.index(AR)
    assert first_try == chooser.window_tokens(1)  # the first window speculated
    second_try = arms.index(SPECULATE, first_try)
    # the AR probe's window, then `windows` windows of AR
    assert second_try - first_try == (1 + windows) * chooser.window_tokens(1)


def test_a_load_above_one_where_ar_won_is_not_probed_while_that_holds():
    """Speculation pays less as load grows: while AR is measured better at 1 session, a probe of speculation at 8
    could only lose (and at 8 it switches every session of the forward), so none runs; once speculation wins at 1,
    8 probes again."""
    chooser = ModeChooser()
    for _ in range(50):  # load 1 measured: speculation at half AR's goodput
        chooser.observe(AR, 1, 1, 0.05)
        chooser.observe(SPECULATE, 1, 1, 0.10)
    assert chooser.choose(1) == AR
    window = chooser.window_tokens(8)
    for _ in range(4 * chooser.max_interval * window):  # longer than any probe interval
        assert chooser.choose(8) == AR
        chooser.observe(AR, 8, 1, 0.05)
    assert chooser.reason(8) == "AR at 8 sessions (AR measured better at 1 sessions)"
    while chooser.buckets[1].best == AR:  # speculation now wins at 1 (its probes measure it)
        arm = chooser.choose(1)
        chooser.observe(arm, 1, 3 if arm == SPECULATE else 1, 0.06 if arm == SPECULATE else 0.05)
    arms = []
    for _ in range(2 * chooser.max_interval * window):
        arms.append(chooser.choose(8))
        chooser.observe(arms[-1], 8, 1, 0.05 if arms[-1] == AR else 0.10)
    assert SPECULATE in arms  # probed again (and lost: speculation at 8 is measured at half AR's goodput)
    assert chooser.buckets[8].best == AR


@pytest.mark.parametrize(("spec_seconds", "quarter"), [(0.10, True), (0.052, False)])
def test_a_clear_losers_probe_lasts_a_quarter_window(spec_seconds, quarter):
    """A probe of an arm measured far behind (speculation at half AR's goodput) only checks that it still loses: a
    quarter of the window; one about as fast gets the whole window."""
    chooser = ModeChooser()
    arms = []
    for _ in range(40 * chooser.window_tokens(2)):
        arm = chooser.choose(2)
        chooser.observe(arm, 2, 1, 0.05 if arm == AR else spec_seconds)  # one token per step in either arm
        arms.append(arm)
    first_try = arms.index(AR)  # the first window speculated, then AR was probed and won
    probe = arms.index(SPECULATE, first_try)
    length = arms.index(AR, probe) - probe
    assert length == (chooser.window_tokens(2) // 4 if quarter else chooser.window_tokens(2))
