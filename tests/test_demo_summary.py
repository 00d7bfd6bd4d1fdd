"""`dspark demo`'s verdict: tok/s with its spread per mode, a comparison with AR only where every round agrees, and
adaptive's choices in words (synthetic runs: the demo's own measurement is not asserted on)."""

from __future__ import annotations

import re

from dspark_grpc.client.demo import Run, adaptive_choices, run_rounds, spread, summary, versus_ar
from dspark_grpc.protos.dspark.v1 import common_pb2


def run(tokens: int, seconds: float, ids: tuple[int, ...] | None = None, **stats) -> Run:
    return Run(ids if ids is not None else tuple(range(tokens)), seconds, common_pb2.GenerationStats(**stats))


def test_one_request_per_mode_claims_no_ratio():
    # the failure the issue saw: a pure-AR adaptive run printed as "2.00x" from one request each
    line = versus_ar([run(100, 1.0)], [run(100, 2.0)])
    assert "too little to compare" in line and not re.search(r"\d\.\d+x", line)


def test_a_direction_only_where_every_round_agrees():
    ar = [run(100, 1.0), run(100, 1.0), run(100, 1.0)]
    assert versus_ar([run(100, 0.5), run(100, 0.8), run(100, 0.9)], ar).startswith("faster than AR in every round")
    assert versus_ar([run(100, 2.0), run(100, 1.25), run(100, 1.1)], ar).startswith("slower than AR in every round")
    mixed = versus_ar([run(100, 0.8), run(100, 1.25), run(100, 1.0)], ar)
    assert mixed.startswith("no consistent difference") and "0.80-1.25x" in mixed


def test_the_spread_is_shown_with_the_median():
    assert spread([10.0, 30.0, 20.0]) == "20.0 (min 10.0, max 30.0, 3 runs)"
    assert spread([42.0]) == "42.0 (one run)"


def test_adaptive_that_never_speculated_says_so_and_why():
    words = adaptive_choices([run(64, 1.0, ar_steps=64), run(64, 1.0, ar_steps=64)])
    assert words.startswith("adaptive ran 0 speculative and 128 AR steps: it decoded AR only")
    assert "mode chooser" in words
    priced = adaptive_choices([run(64, 1.0, ar_steps=64, planned_ar_steps=64)])
    assert priced.startswith("adaptive ran 0 speculative and 64 AR steps: it decoded AR only, because at every step "
                             "the planner's cost tables priced")
    mixed = adaptive_choices([run(64, 1.0, ar_steps=10, speculative_steps=20, planned_ar_steps=3,
                                  fallback_reason="drafter unreachable")])
    assert "20 speculative and 10 AR steps" in mixed and "3 of the AR steps were AR because" in mixed
    assert "drafter unreachable" in mixed


def test_rounds_interleave_the_modes_and_the_summary_checks_outputs():
    order = []

    def generate(mode: str) -> Run:
        order.append(mode)
        return run(4, {"ar": 1.0, "speculation": 2.0}[mode], ids=(1, 2, 3, 4) if mode == "ar" or len(order) < 4
                   else (1, 2, 3, 5), speculative_steps=1 if mode == "speculation" else 0, acceptance_length=1.5)

    runs = run_rounds(generate, ("ar", "speculation"), rounds=2)
    assert order == ["ar", "speculation", "ar", "speculation"]
    lines = summary(runs, compare=True)
    assert lines[0] == "         ar: 4.0 (min 4.0, max 4.0, 2 runs) tok/s"
    assert "acceptance length 1.50" in lines[1]
    assert lines[2].startswith("speculation vs AR: slower than AR in every round")
    assert lines[-1].endswith("NO")  # the second round's speculative output differs
    assert not any("identical" in line for line in summary(runs, compare=False))
