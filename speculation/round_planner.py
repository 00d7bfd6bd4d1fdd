"""How much of each drafted chain a speculative round verifies, decided for the round as a whole.

The sessions of a round verify in one target forward, so a row one session adds is paid by all of them. Each
drafted chain carries confidences c_1..c_k (the DSpark confidence head); with a calibration g (the ratio of the
EMAs of accepted and predicted draft tokens), s_{i,d} = min(1, g * prod_{j<=d} c_{i,j}) is the chance that session i
accepts its draft token d. Verifying m_i tokens of each chain, the forward's expected goodput is

    rate(m) = (N + sum_i sum_{d<=m_i} s_{i,d}) / (T(N, (N + sum_i m_i) / N) + F)

with N the round's sessions, T the target's cost table (seconds of one forward of N sessions x r rows each) and F
what the round costs whatever is verified (the drafter's round: paid once the chains are drafted, it makes each
verified row relatively cheaper).
Along a chain s_{i,d} only decreases, so taking the draft tokens in order of s (the most likely first) keeps a
prefix of every chain; the plan is the best prefix of that order. Every session verifies at least `min_depth`
tokens (1 in mode speculation: it drafts every step; 0 in mode adaptive, where a session cut to depth 0 runs an AR
step). As sessions grow a row costs more and the plan shrinks, down to AR where rows stop paying.

Whether x_d is verified depends only on confidences of x_<=d, hence on x_<d: a prefix of a draft is verified
exactly as a whole draft is, so the output does not change.

Sessions that step AR share the forward too (`besides`: a row each): their requests did not ask for speculation and
must not pay for it beyond sharing a forward. Beside them the draft rows of a forward are capped (`rows_beside`) so
that it costs at most AR_NEIGHBOUR_SLOWDOWN x what it costs at one row per session, and the speculating sessions
take turns to draft (`draft_share`, priced with their drafter rounds): each drafts on that share of its steps and
steps AR on the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

AR_NEIGHBOUR_SLOWDOWN = 1.25  # the most a forward shared with AR sessions may cost over its one row per session


def plan_depths(confidences: Sequence[Sequence[float]], min_depths: Sequence[int], calibration: float,
                seconds: Callable[[int, float], float], fixed_seconds: float = 0.0, besides: int = 0,
                max_draft_rows: int | None = None) -> list[int]:
    """Depth to verify per chain. `seconds(lanes, rows_per_lane)` is the forward's cost, `fixed_seconds` F;
    `besides` sessions step AR in the same forward (one row and one token each); the chains verify at most
    `max_draft_rows` draft tokens beyond their `min_depths`."""
    n = len(confidences)
    assert len(min_depths) == n and besides >= 0
    if n == 0:
        return []
    survival: list[list[float]] = []
    for cs in confidences:
        s, p = [], 1.0
        for c in cs:
            p *= min(max(float(c), 0.0), 1.0)
            s.append(min(1.0, calibration * p))
        survival.append(s)
    depths = [min(m, len(s)) for m, s in zip(min_depths, survival, strict=True)]
    lanes = n + besides
    expected = float(lanes) + sum(sum(s[:m]) for s, m in zip(survival, depths, strict=True))
    rows = lanes + sum(depths)
    order = sorted(((s[d], i, d) for i, s in enumerate(survival) for d in range(depths[i], len(s))),
                   key=lambda x: (-x[0], x[2], x[1]))
    if max_draft_rows is not None:
        order = order[:max(0, max_draft_rows)]
    best, best_rate = 0, expected / (seconds(lanes, rows / lanes) + fixed_seconds)
    for taken, (p, _, _) in enumerate(order, start=1):
        expected += p
        rows += 1
        rate = expected / (seconds(lanes, rows / lanes) + fixed_seconds)
        if rate > best_rate:
            best, best_rate = taken, rate
    for _, i, d in order[:best]:  # a prefix of the order holds a prefix of each chain
        depths[i] = max(depths[i], d + 1)
    return depths


def rows_beside(lanes: int, seconds: Callable[[int, float], float], slowdown: float = AR_NEIGHBOUR_SLOWDOWN,
                most: int = 1024) -> int:
    """The draft rows a forward of `lanes` sessions (a row each) may add and cost at most `slowdown` x as much."""
    assert lanes >= 1
    limit, low, high = slowdown * seconds(lanes, 1.0), 0, most
    while low < high:  # (a forward's cost grows with its rows)
        mid = (low + high + 1) // 2
        if seconds(lanes, (lanes + mid) / lanes) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


def draft_share(lanes: int, speculating: int, seconds: Callable[[int, float], float], rows_per_draft: float,
                round_seconds: float, slowdown: float = AR_NEIGHBOUR_SLOWDOWN) -> float:
    """The share of their steps on which `speculating` sessions, of the `lanes` that step together, may draft so that
    their drafting adds at most (`slowdown` - 1) x the forward's cost at one row per session. A turn costs its
    `rows_per_draft` draft rows in the forward and its drafter round's `round_seconds` (on a CPU the draft service
    shares, a round's computation delays the target's forward about as long)."""
    assert lanes >= 1 and speculating >= 1
    base = seconds(lanes, 1.0)
    turn = seconds(lanes, (lanes + max(rows_per_draft, 1.0)) / lanes) - base + round_seconds
    return min(1.0, (slowdown - 1.0) * base / (speculating * turn)) if turn > 0 else 1.0


@dataclass
class RoundCalibration:
    """What the planner learns from served rounds (thread-safe): g, the ratio of the EMAs of accepted and predicted
    draft tokens over verified chains, F, the EMA of the seconds a step waited for its drafter round, and the EMA of
    the draft rows a drafting step verified."""

    alpha: float = 0.1
    sums: tuple[float, float] = (1.0, 1.0)  # starts trusting the confidences
    round_seconds: float = 0.0
    draft_rows: float = 0.0  # (0 before the first drafting step)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def value(self) -> float:
        accepted, predicted = self.sums
        return min(max(accepted / predicted, 0.02), 2.0) if predicted > 0 else 1.0

    def observe_round(self, seconds: float) -> None:
        with self.lock:
            first = self.round_seconds == 0.0
            self.round_seconds = seconds if first else self.round_seconds + self.alpha * (seconds - self.round_seconds)

    def observe_draft_rows(self, rows: int) -> None:
        with self.lock:
            first = self.draft_rows == 0.0
            self.draft_rows = rows if first else self.draft_rows + self.alpha * (rows - self.draft_rows)

    def observe(self, predicted: float, accepted: int) -> None:
        with self.lock:
            acc, pred = self.sums
            acc += self.alpha * (accepted - acc)
            pred += self.alpha * (predicted - pred)
            self.sums = (acc, pred)


def predicted_accepted(confidences: Sequence[float], depth: int) -> float:
    """sum_{d<=depth} prod_{j<=d} c_j: what the uncalibrated confidences predict for a chain cut to `depth`."""
    survival, expected = 1.0, 0.0
    for c in confidences[:depth]:
        survival *= min(max(float(c), 0.0), 1.0)
        expected += survival
    return expected
