"""The adaptive planner: per step, AR or which proposer, and how much of a confident chain to verify.

Each option ("arm": AR, or a proposer of the drafter) has running estimates from the steps that used it: accepted
draft tokens per step, rows verified per step and seconds spent drafting. Its value is the expected goodput of
the batched forwards it takes part in, if every session in them did the same (they all run this planner):

    rate(arm) = L * (1 + accepted) / (T(L, 1) * k * relative_cost + draft_seconds)

where relative_cost is the arm's mean of T(L, rows) / T(L, 1) over its steps (a mean of costs, not the cost of the
mean rows: a CPU step of 1 row is much cheaper than one of 2, so prompt lookup that drafts 8 rows one step in eight
costs far less than T(2) per step), L is the number of sessions in the target's recent forwards (an EMA of what the
target reports), T the target's start-up cost table (seconds of one forward of L sessions x r rows each) and k its
online correction (speculation/cost_table.py `Correction`: measured / predicted forward time, per shape). Pricing
every session's rows, not only one's own, is what makes speculation back off under load: a session alone would see
only its small share of a crowded forward. Without cost tables the planner uses each arm's measured step seconds
instead. The best arm runs (a drafting arm must beat AR by `margin`); an arm not chosen is probed again after
`probe_every` steps, the interval doubling while probes lose.
An arm whose drafting costs under `cheap` of an AR step (prompt lookup) is kept while its rate is within
`cheap_keep` of AR's and probed without back-off: its wins come in bursts and a wasted try costs next to nothing.

A chain that carries confidences c_1..c_k (the DSpark confidence head) is cut to the depth m that maximizes
L * (1 + sum_{d<=m} s_d) / T(L, 1 + m) with s_d = min(1, g * prod_{j<=d} c_j), g an online
calibration: the ratio of the EMAs of accepted tokens and of sum_d prod_{j<=d} c_j over the kept depths (a ratio of
means; an EMA of per-step ratios drifts to zero, since most steps accept nothing). Whether x_d is verified depends
only on c_1..c_d, hence on x_<d: a prefix of a draft is verified exactly as a whole draft is, so the output does not
change.

Estimates start from a `PlannerMemory` shared by the requests of one client or server, so a drafter that never
wins (e.g. random weights) is recognised by the next request at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from dspark_grpc.speculation.cost_table import Correction, VerifyCosts

AR = 0  # the AR arm; drafting arms are draft_pb2.Proposer values (> 0)


@dataclass
class ArmStats:
    accepted: float = 0.0  # accepted draft tokens per step
    relative_cost: float = 1.0  # forward seconds per step / those of an AR step (from the cost tables)
    draft_seconds: float = 0.0
    step_seconds: float = 0.0  # draft + verify wall time of a step (used without cost tables)
    steps: int = 0

    def update(self, alpha: float, accepted: float, relative_cost: float, draft_seconds: float,
               step_seconds: float) -> None:
        a = max(1.0 / (self.steps + 1), alpha)  # a plain mean at first, then an EMA
        self.accepted += a * (accepted - self.accepted)
        self.relative_cost += a * (relative_cost - self.relative_cost)
        self.draft_seconds += a * (draft_seconds - self.draft_seconds)
        self.step_seconds += a * (step_seconds - self.step_seconds)
        self.steps += 1


@dataclass
class PlannerMemory:
    """Arm estimates carried from one request to the next (thread-safe)."""

    arms: dict[int, ArmStats] = field(default_factory=dict)
    calibration: float = 1.0
    calibration_sums: tuple[float, float] = (1.0, 1.0)
    correction: Correction = field(default_factory=Correction)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, planner: StepPlanner) -> None:
        """Start `planner` from the stored estimates."""
        with self.lock:
            planner.stats.update({k: ArmStats(**{f: getattr(v, f) for f in ArmStats.__dataclass_fields__})
                                  for k, v in self.arms.items() if k in planner.stats})
            planner.calibration, planner.calibration_sums = self.calibration, self.calibration_sums
            planner.correction = self.correction.copy()

    def store(self, planner: StepPlanner) -> None:
        with self.lock:
            self.arms = {k: v for k, v in planner.stats.items() if v.steps}
            self.calibration, self.calibration_sums = planner.calibration, planner.calibration_sums
            self.correction = planner.correction.copy()


class StepPlanner:
    def __init__(self, arms: Sequence[int], costs: VerifyCosts | None = None, memory: PlannerMemory | None = None,
                 margin: float = 1.02, probe_every: int = 8, max_probe_every: int = 256, alpha: float = 0.1,
                 cheap: float = 0.05, cheap_keep: float = 0.97) -> None:
        if not arms or AR in arms:
            raise ValueError(f"drafting arms must be proposer values > 0, got {list(arms)}")
        self.drafting = list(arms)
        self.costs = costs if costs else None
        self.memory = memory
        self.margin, self.alpha, self.cheap, self.cheap_keep = margin, alpha, cheap, cheap_keep
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.stats = {arm: ArmStats() for arm in [AR, *self.drafting]}
        self.interval = {arm: probe_every for arm in self.drafting}
        self.since = {arm: 0 for arm in self.drafting}
        self.lanes = 1.0  # sessions per target forward (EMA)
        self.correction = Correction()  # of the cost tables: measured / predicted forward seconds
        self.calibration = 1.0
        self.calibration_sums = (1.0, 1.0)  # EMAs of (accepted, predicted) draft tokens; starts trusting c_k
        if memory is not None:
            memory.load(self)
        self.current: int | None = None
        self.switches: list[str] = []
        self.planned_ar = 0
        self.truncated = 0

    # -- estimates ------------------------------------------------------------------------------------

    def forward_seconds(self, rows: float, lanes: float | None = None) -> float:
        """Predicted seconds of a target forward of `lanes` sessions (default: the recent mean) x `rows` each."""
        assert self.costs is not None
        return self.costs.seconds(self.lanes if lanes is None else lanes, rows) * self.speed_for(rows)

    def speed_for(self, rows: float) -> float:
        return self.correction.factor(rows)

    def rate(self, arm: int) -> float | None:
        """Expected tokens per second of the forward this arm's step joins (None: not measured yet)."""
        s = self.stats[arm]
        if self.costs is None:
            if not s.steps or s.step_seconds <= 0:
                return None
            return (1.0 + s.accepted) / s.step_seconds
        if arm != AR and not s.steps:
            return None
        return self.lanes * (1.0 + s.accepted) / (self.forward_seconds(1) * s.relative_cost + s.draft_seconds)

    # -- decisions ------------------------------------------------------------------------------------

    def choose(self, step: int) -> int:
        """The arm for this step: AR or a proposer."""
        untried = [a for a in self.drafting if not self.stats[a].steps]
        if untried:
            return self._set(untried[0], step, "first try")
        if self.costs is None and not self.stats[AR].steps:
            return self._set(AR, step, "measure AR")
        ar_rate = self.rate(AR) or 0.0
        best, best_rate = AR, ar_rate
        for arm in self.drafting:
            r = self.rate(arm) or 0.0
            # a cheap arm (drafting costs < `cheap` of an AR step) is kept unless it measurably loses: its wins
            # come in bursts that a short average misses, and a wasted try costs next to nothing
            score = r / (self.cheap_keep if self._cheap(arm) else self.margin)
            if score > best_rate:
                best, best_rate = arm, score
        for arm in self.drafting:  # probe an arm that lost long enough ago
            if arm != best:
                self.since[arm] += 1
                if self.since[arm] >= self.interval[arm]:
                    self.since[arm] = 0
                    if not self._cheap(arm):
                        self.interval[arm] = min(2 * self.interval[arm], self.max_probe_every)
                    return self._set(arm, step, None)
        if best != AR:
            self.interval[best] = self.probe_every
        expected = (self.rate(best) or 0.0) / max(ar_rate, 1e-12)
        return self._set(best, step, f"{expected:.2f}x AR expected")

    def _cheap(self, arm: int) -> bool:
        ar = self.stats[AR]
        ar_seconds = self.forward_seconds(1) if self.costs is not None else ar.step_seconds
        return ar_seconds > 0 and self.stats[arm].draft_seconds < self.cheap * ar_seconds

    def _set(self, arm: int, step: int, why: str | None) -> int:
        if why is not None and arm != self.current:
            if self.current is not None:
                self.switches.append(f"step {step}: {_name(arm)} ({why})")
            self.current = arm
        if arm == AR:
            self.planned_ar += 1
        return arm

    def cut_chain(self, confidences: Sequence[float]) -> int:
        """How many draft tokens of a chain with these per-position confidences to verify (see module doc)."""
        if self.costs is None or not confidences:
            return len(confidences)
        best_m, best, survival, expected = 0, 1.0 / self.forward_seconds(1), 1.0, 0.0
        for m, c in enumerate(confidences, start=1):
            survival *= min(max(float(c), 0.0), 1.0)
            expected += min(1.0, self.calibration * survival)
            value = (1.0 + expected) / self.forward_seconds(1 + m)
            if value > best:
                best_m, best = m, value
        if best_m < len(confidences):
            self.truncated += 1
        return best_m

    # -- observations -----------------------------------------------------------------------------------

    def observe(self, arm: int, rows: int, accepted: int, draft_seconds: float, step_seconds: float,
                verify_seconds: float, batch_sessions: int, batch_rows: int,
                predicted_accepted: float | None = None) -> None:
        """One finished step: its arm, rows verified, draft tokens accepted, seconds, and the forward it ran in."""
        a = self.alpha
        if batch_sessions > 0:
            self.lanes += a * (batch_sessions - self.lanes)
        if self.costs is not None and verify_seconds > 0 and batch_sessions > 0:
            per_session = batch_rows / batch_sessions
            self.correction.observe(per_session, self.costs.seconds(batch_sessions, per_session), verify_seconds, a)
        if predicted_accepted is not None:
            acc, pred = self.calibration_sums
            acc += a * (accepted - acc)
            pred += a * (predicted_accepted - pred)
            self.calibration_sums = (acc, pred)
            self.calibration = min(max(acc / pred, 0.02), 2.0) if pred > 0 else self.calibration
        relative = 1.0
        if self.costs is not None:
            # >= 1: verifying rows never costs less than an AR step, though per-shape corrections measured on a
            # noisy machine can say so (and then a drafter that is never right looked free)
            lanes = batch_sessions or self.lanes
            relative = max(1.0, self.forward_seconds(rows, lanes) / self.forward_seconds(1, lanes))
        self.stats[arm].update(a, accepted, relative, draft_seconds, step_seconds)

    def finish(self) -> None:
        if self.memory is not None:
            self.memory.store(self)


def _name(arm: int) -> str:

    from dspark_grpc.speculation.wire import PROPOSER_NAMES

    return "AR" if arm == AR else PROPOSER_NAMES.get(arm, str(arm))
