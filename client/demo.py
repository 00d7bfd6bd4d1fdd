"""`dspark demo`'s measurement: the modes in turn over several rounds, each mode's tok/s with its spread, and a
comparison with AR only where every round agrees (one request per mode cannot support a ratio)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.speculation.wire import ADAPTIVE, AR


@dataclass(frozen=True)
class Run:
    """One request: its tokens, its end-to-end seconds (as the caller saw them) and the target's stats."""

    token_ids: tuple[int, ...]
    seconds: float
    stats: common_pb2.GenerationStats

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def run_rounds(generate: Callable[[str], Run], modes: Sequence[str], rounds: int,
               progress: Callable[[str], None] | None = None) -> dict[str, list[Run]]:
    """`rounds` rounds, each running every mode once in turn (a drift of the machine's speed hits all modes alike)."""
    runs: dict[str, list[Run]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes:
            runs[mode].append(generate(mode))
        if progress:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(f"{m} {runs[m][-1].tokens_per_s:.1f}" for m in modes)
                     + " tok/s")
    return runs


def spread(values: Sequence[float]) -> str:
    """`median (min-max, n runs)`."""
    if len(values) == 1:
        return f"{values[0]:.1f} (one run)"
    return f"{statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f}, {len(values)} runs)"


def versus_ar(mode_runs: Sequence[Run], ar_runs: Sequence[Run]) -> str:
    """How a mode compares with AR, from the ratio of each round (the two ran in turn): a direction only where every
    round agrees."""
    ratios = [m.tokens_per_s / a.tokens_per_s for m, a in zip(mode_runs, ar_runs, strict=True) if a.tokens_per_s]
    if len(ratios) < 2:
        return "one round: too little to compare with AR (run more rounds)"
    span = f"per-round ratios to AR {min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x"
    if min(ratios) > 1:
        return f"faster than AR in every round ({span})"
    if max(ratios) < 1:
        return f"slower than AR in every round ({span})"
    return f"no consistent difference from AR ({span}: the rounds disagree)"


def adaptive_choices(runs: Sequence[Run]) -> str:
    """In words: what the adaptive requests ran, and why (from the target's stats)."""
    spec = sum(r.stats.speculative_steps for r in runs)
    ar = sum(r.stats.ar_steps for r in runs)
    planned_ar = sum(r.stats.planned_ar_steps for r in runs)
    reasons = sorted({r.stats.fallback_reason for r in runs if r.stats.fallback_reason})
    words = f"adaptive ran {spec} speculative and {ar} AR steps"
    priced = "the planner's cost tables priced a speculative step (the draft and the wider verify) above the tokens " \
             "it expected from it"
    if spec == 0 and ar and planned_ar >= ar:
        words += f": it decoded AR only, because at every step {priced}"
    else:
        if spec == 0:
            words += (": it decoded AR only. The target's mode chooser runs whichever of AR and speculation it "
                      "measures (or, before measuring, its cost tables predict) to give more tokens per second at "
                      "this load; here that was AR")
        elif ar:
            words += (": the target's mode chooser runs the arm it measures faster at this load and probes the other "
                      "now and then")
        if planned_ar:
            words += f"; {planned_ar} of the AR steps were AR because {priced}"
    if reasons:
        words += "; speculation stopped: " + "; ".join(reasons)
    return words + "."


def summary(runs: dict[str, list[Run]], compare: bool) -> list[str]:
    """The lines the demo ends with: tok/s per mode with its spread, each mode against AR, adaptive's choices."""
    lines = []
    for mode, mode_runs in runs.items():
        line = f"{mode:>11}: {spread([r.tokens_per_s for r in mode_runs])} tok/s"
        accepted = [r.stats.acceptance_length for r in mode_runs if r.stats.speculative_steps]
        if accepted:
            line += f"; acceptance length {statistics.median(accepted):.2f} tokens per speculative step"
        lines.append(line)
    if AR in runs:
        for mode, mode_runs in runs.items():
            if mode != AR:
                lines.append(f"{mode} vs AR: {versus_ar(mode_runs, runs[AR])}")
    if ADAPTIVE in runs:
        lines.append(adaptive_choices(runs[ADAPTIVE]))
    if compare:
        reference = runs[next(iter(runs))][0].token_ids
        same = all(r.token_ids == reference for mode_runs in runs.values() for r in mode_runs)
        lines.append(f"outputs identical in every mode and round: {'yes' if same else 'NO'}")
    return lines
