"""The adaptive gate's decisions on synthetic step timings (no services, no clock)."""

from __future__ import annotations

from dspark_grpc.client.generation import AdaptiveGate


def run(gate: AdaptiveGate, steps: int, ar_s: float, spec_s: float, spec_tokens: int) -> list[bool]:
    decisions = []
    for step in range(1, steps + 1):
        draft = gate.want_draft()
        decisions.append(draft)
        gate.observe(draft, spec_s if draft else ar_s, spec_tokens if draft else 1, step)
    return decisions


def test_keeps_drafting_while_it_pays():
    # 3 tokens per 1.5 AR-step times: 2x AR
    decisions = run(AdaptiveGate(), 40, ar_s=0.05, spec_s=0.075, spec_tokens=3)
    assert decisions[0] and not decisions[1]  # try drafting once, then measure one AR step
    assert all(decisions[2:])


def test_stops_when_it_does_not_pay_and_reprobes():
    gate = AdaptiveGate(probe_every=10)
    decisions = run(gate, 60, ar_s=0.05, spec_s=0.09, spec_tokens=1)  # drafts never accepted
    assert sum(decisions) <= 1 + 60 // 10
    assert all(not d for d in decisions[1:10])
    assert gate.switches and "AR" in gate.switches[0]


def test_switches_back_when_drafts_start_paying():
    gate = AdaptiveGate(probe_every=5)
    run(gate, 20, ar_s=0.05, spec_s=0.09, spec_tokens=1)
    assert not gate.speculating
    later = run(gate, 30, ar_s=0.05, spec_s=0.07, spec_tokens=4)  # e.g. the text starts repeating itself
    assert gate.speculating and sum(later[-10:]) == 10
    assert "speculation" in gate.switches[-1]
