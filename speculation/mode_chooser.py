"""Adaptive mode: whether the target's adaptive sessions speculate or decode AR, decided for the target as a whole
per load (the sessions stepping at once), from measured goodput.

A speculative step is paid by every session in its forward (wider rows) and by the drafter's pass, which on shared
cores competes with the target. What that costs depends on the load, the machine and whatever else runs on it, so
the chooser measures instead of predicting. Every step a session runs with the target's drafter or without it, in
any mode, is a sample of its arm (AR or SPECULATE) at its load bucket (of the sessions live when it ended): the
tokens it committed and the seconds since the same session's previous step ended (the drafter's wait, the verify,
the round trip: all a session waits for); a session's first step in the other arm pays for the switch and is left
out, as is a step that waited for another session's prompt (the target feeds the samples). A session's goodput with
an arm is the ratio of the EMAs of the two; at a fixed load the target's goodput is that times the load, so the arms
compare by it.

Per bucket one arm runs at a time, in windows of `window_tokens(load)` committed tokens (so a window of the slower
arm does not last much longer): the better measured arm runs, and the other is probed with one window after
`interval` windows (it takes over if it wins by `margin`), the interval doubling (up to `max_interval`) each time
the probe loses (quadrupling, up to 4 x `max_interval`, when it loses by far) and dropping back to `min_interval`
when it wins (to `max_interval` when the arm it displaced lost by far: a first try of speculation that the AR
probe beats clearly is not tried again a few windows later). A bucket whose arms other sessions' steps measured
already starts with the better one (a clear loser is first probed after `max_interval` windows: at high load one
probe of it costs far more than its own steps, since every session of the forward switches, catches its drafter up
and comes back unevenly). A bucket never
measured starts from its neighbours (speculation pays less as load grows: a load that AR wins at fewer sessions
starts with AR, probed as rarely as a clear loser) or else with the arm that `predicted_speedup` favours (the
target's cost table, the acceptance and drafting seconds measured at any load so far), and probes the other after
its first window unless that was clear (a clearly predicted loser too is first probed after `max_interval`).
A clear loser's probe lasts a quarter window. Nor is a bucket probed while a neighbour settles it: AR measured
better at fewer sessions (or speculation at more) wins there too, so its probe could only lose.

Speculation is lossless, so which arm runs never changes the output.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from dspark_grpc.speculation import wire
from dspark_grpc.speculation.cost_table import VerifyCosts

AR, SPECULATE = 0, 1
ARM_NAMES = {AR: "AR", SPECULATE: wire.SPECULATION}


def load_bucket(load: int) -> int:
    """1, 2, 3, 4, then the next power of two: loads that cost about the same share their estimates."""
    load = max(1, load)
    if load <= 4:
        return load
    return 1 << (load - 1).bit_length()


@dataclass
class ArmRate:
    """Ratio of EMAs: tokens committed and seconds waited per step. The tokens of a speculative step vary far more
    (1 to 1 + depth) than its seconds and hardly with the machine, so they are averaged over 4x as many steps."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, alpha: float) -> None:
        first = 1.0 / (self.steps + 1)  # a plain mean at first, then EMAs
        self.tokens += max(alpha / 4, first) * (tokens - self.tokens)
        self.seconds += max(alpha, first) * (seconds - self.seconds)
        self.steps += 1

    @property
    def per_second(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None


@dataclass
class Bucket:
    rates: dict[int, ArmRate] = field(default_factory=lambda: {AR: ArmRate(), SPECULATE: ArmRate()})
    arm: int | None = None  # the arm of the current window (None: not started)
    window_left: int = 0  # tokens `arm` still has to commit in this window
    best: int | None = None  # the measured better arm
    since_probe: int = 0  # windows of the better arm since the last probe
    interval: int = 2
    probing: bool = False
    reason: str = ""


@dataclass
class Spending:
    """What speculation costs and gives, measured at any load: draft tokens accepted, rows verified per session and
    seconds waited for the drafter per speculative step (EMAs)."""

    accepted: float = 0.0
    rows: float = 1.0
    draft_seconds: float = 0.0
    steps: int = 0


class ModeChooser:
    def __init__(self, costs: VerifyCosts | None = None, alpha: float = 0.02, window_per_session: int = 8,
                 min_window: int = 32, min_interval: int = 4, max_interval: int = 32, clear: float = 0.2,
                 margin: float = 1.03, load_memory_s: float = 1.0) -> None:
        self.costs = costs
        self.alpha = alpha
        self.window_per_session, self.min_window = window_per_session, min_window
        self.min_interval, self.max_interval = min_interval, max_interval
        self.clear = clear  # a difference in goodput taken as clear (no need to measure the other arm soon)
        self.margin = margin
        self.load_memory_s = load_memory_s
        self._loads: deque[tuple[float, int]] = deque()  # (time, sessions live) over the last load_memory_s
        self.buckets: dict[int, Bucket] = {}
        self.spending = Spending()
        self.lock = threading.Lock()

    def load(self, live: int, now: float) -> int:
        """The load to decide and measure by: the most sessions live in the last `load_memory_s` seconds. Between a
        request that ends and the next one that opens the count dips; that is not a change of load, and a bucket
        switched for it would run the other arm for a step (at 4 sessions, 3 speculated while 4 ran AR)."""
        with self.lock:
            self._loads.append((now, live))
            while self._loads and self._loads[0][0] < now - self.load_memory_s:
                self._loads.popleft()
            return max(n for _, n in self._loads)

    def window_tokens(self, load: int) -> int:
        return max(self.min_window, self.window_per_session * load)

    # -- the prior -------------------------------------------------------------------------------------

    def predicted_speedup(self, load: int) -> float | None:
        """Speculation's goodput over AR's at `load`, from the cost table and what speculation measured so far at
        any load: load * (1 + accepted) / (T(load, rows) + draft seconds) against load / T(load, 1).
        None without a cost table or a speculative step."""
        s = self.spending
        if self.costs is None or not s.steps:
            return None
        ar = self.costs.seconds(load, 1.0)
        spec = self.costs.seconds(load, max(1.0, s.rows)) + s.draft_seconds
        return (1.0 + s.accepted) * ar / spec

    # -- decisions -------------------------------------------------------------------------------------

    def choose(self, load: int) -> int:
        """The arm for a step that starts now among `load` stepping sessions."""
        with self.lock:
            b = self.buckets.setdefault(load_bucket(load), Bucket(interval=self.min_interval))
            if b.arm is None:
                self._start(b, load)
            return b.arm

    def reason(self, load: int) -> str:
        """Why the bucket of `load` runs its arm (for the step reports)."""
        with self.lock:
            b = self.buckets.get(load_bucket(load))
            return f"{ARM_NAMES[b.arm]} at {load} sessions ({b.reason})" if b and b.arm is not None else ""

    def observe(self, arm: int, load: int, tokens: int, seconds: float, accepted: int = 0, rows: float = 1.0,
                draft_seconds: float = 0.0) -> None:
        """One finished step: the arm it ran, the load it ran at, the tokens it committed and the seconds the
        session waited for it; for a speculative step also the draft tokens accepted, rows verified and seconds
        waited for the drafter."""
        if seconds <= 0:
            return
        with self.lock:
            if arm == SPECULATE:
                s, a = self.spending, max(self.alpha, 1.0 / (self.spending.steps + 1))
                s.accepted += a * (accepted - s.accepted)
                s.rows += a * (rows - s.rows)
                s.draft_seconds += a * (draft_seconds - s.draft_seconds)
                s.steps += 1
            b = self.buckets.setdefault(load_bucket(load), Bucket(interval=self.min_interval))
            b.rates[arm].add(tokens, seconds, self.alpha)
            if arm != b.arm:
                return  # planned before the window changed: a sample, but not a step of this window
            b.window_left -= tokens
            if b.window_left <= 0:
                self._next_window(b, load)

    def _start(self, b: Bucket, load: int) -> None:
        """A bucket's first window: the better arm if steps of other sessions (any mode) measured both. Speculation pays
        less as load grows, so a load that loses to AR at fewer sessions starts with AR (and one that wins at more
        sessions speculates) without probing the other arm at once; else the cost table's prediction starts it (a clear
        one also waits to probe)."""
        n = load_bucket(load)
        fewer = [m for m, o in self.buckets.items() if m < n and o.best == AR]
        more = [m for m, o in self.buckets.items() if m > n and o.best == SPECULATE]
        predicted = self.predicted_speedup(load)
        ar, spec = b.rates[AR].per_second, b.rates[SPECULATE].per_second
        if ar is not None and spec is not None:  # other sessions' steps measured both already
            b.arm = b.best = AR if ar >= spec else SPECULATE
            b.reason = f"measured {spec / ar:.2f}x AR speculating"
            if abs(spec / ar - 1.0) > self.clear:  # a clear loser: first probed after max_interval windows
                b.interval = self.max_interval
        elif fewer:  # speculation pays less as load grows: as clear as a measured loser
            b.arm = b.best = AR
            b.interval = self.max_interval
            b.reason = f"AR measured better at {max(fewer)} sessions"
        elif more:
            b.arm = b.best = SPECULATE
            b.reason = f"speculation measured better at {min(more)} sessions"
        elif predicted is not None:
            b.arm = AR if predicted < 1.0 else SPECULATE
            b.best = b.arm if abs(predicted - 1.0) > self.clear else None
            if b.best == AR:  # a clear loser by the prediction: probed as rarely as a measured one
                b.interval = self.max_interval
            b.reason = f"predicted {predicted:.2f}x AR"
        else:  # nothing to go by: speculate first (AR is measured as soon as speculation loses)
            b.arm, b.reason = SPECULATE, "first try"
        b.window_left = self.window_tokens(load)

    def _next_window(self, b: Bucket, load: int) -> None:
        assert b.arm is not None
        b.window_left = self.window_tokens(load)
        rates = {arm: r.per_second for arm, r in b.rates.items()}
        other = SPECULATE if b.arm == AR else AR
        if rates[other] is None and b.best is None:  # nothing says which is better: measure the other now
            b.arm, b.probing, b.reason = other, True, "probe"
            return
        best, far = b.best, False
        if rates[AR] is not None and rates[SPECULATE] is not None:
            ratio = rates[SPECULATE] / rates[AR]
            # the other arm must win by `margin` to take over: arms about as fast would swap every window, and a
            # switch costs (AR -> speculation: the drafter catches up on the rows it missed, nothing drafted ahead)
            if b.best is None:
                best = SPECULATE if ratio > 1.0 else AR
            elif ratio > self.margin or ratio < 1.0 / self.margin:
                best = SPECULATE if ratio > 1.0 else AR
            b.reason = f"measured {ratio:.2f}x AR speculating"
            deficit = 1.0 - min(rates[AR], rates[SPECULATE]) / max(rates[AR], rates[SPECULATE])
            far = deficit > self.clear  # a clear loser backs off further: each probe of it costs that much
            if b.probing and best == b.arm:  # the probe won: the arm it displaced is probed soon, unless it lost by far
                b.interval = self.max_interval if far else self.min_interval
            elif b.probing:  # lost: probe less often, much less if it lost by far
                b.interval = min(b.interval * (4 if far else 2), self.max_interval * (4 if far else 1))
        assert best is not None
        b.best = best
        b.since_probe = 0 if b.probing else b.since_probe + 1
        due = not b.probing and b.since_probe >= b.interval
        settled = self._settled_by_neighbours(load, best) if due else ""
        if due and not settled:
            b.arm, b.probing, b.reason = (SPECULATE if best == AR else AR), True, f"probe ({b.reason})"
            if far:  # a clear loser's probe checks that it still loses: a quarter window (its samples are EMAs anyway)
                b.window_left = max(1, b.window_left // 4)
            return
        b.arm, b.probing = best, False
        if settled:  # a probe here could only lose: not run (while the neighbour holds)
            b.since_probe, b.reason = 0, settled

    def _settled_by_neighbours(self, load: int, best: int) -> str:
        """Why probing the other arm at `load` is pointless ("" if it is not): speculation pays less as load grows,
        so AR measured better at fewer sessions wins here too, as speculation measured better at more sessions
        does. At high load a probe switches every session of the forward and costs far more than its own steps."""
        n = load_bucket(load)
        if best == AR:
            fewer = [m for m, o in self.buckets.items() if m < n and o.best == AR]
            return f"AR measured better at {max(fewer)} sessions" if fewer else ""
        more = [m for m, o in self.buckets.items() if m > n and o.best == SPECULATE]
        return f"speculation measured better at {min(more)} sessions" if more else ""

    def summary(self) -> dict[int, dict[str, float | None]]:
        """Per load bucket: each arm's measured tokens per second per session, speculation's measured and
        predicted speed-up over AR, and whether it speculates now."""
        with self.lock:
            out = {}
            for n, b in sorted(self.buckets.items()):
                ar, spec = b.rates[AR].per_second, b.rates[SPECULATE].per_second
                out[n] = {wire.AR: ar, wire.SPECULATION: spec, "measured_speedup": spec / ar if ar and spec else None,
                          "predicted_speedup": self.predicted_speedup(n), "speculating": float(b.arm == SPECULATE)}
            return out
