"""SpecDecodeMetrics: vLLM's spec-decode counters from hand-built GenerationStats, the text exposition and the
/metrics HTTP server."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.speculation.metrics import SpecDecodeMetrics, reason_label, start_metrics_server

prometheus_client = pytest.importorskip("prometheus_client")


def _spec_stats() -> common_pb2.GenerationStats:
    """4 steps: drafts of depth 3, 3, 2 (accepted 2, 0, 2) and one AR step; 1 + 3 + 1 + 3 + 1 = 9 tokens."""
    return common_pb2.GenerationStats(
        prompt_tokens=5, generated_tokens=9, steps=4, mode_run=common_pb2.DECODE_MODE_SPECULATION,
        acceptance_length=2.0, draft_seconds=0.3, verify_seconds=0.8, ar_steps=1, speculative_steps=3,
        committed_per_step=[3, 1, 3, 1], accepted_by_proposer={"dspark": 3, "ngram": 1},
        drafted_per_position=[3, 3, 2], accepted_per_position=[2, 2, 0])


def _ar_stats(reason: str = "") -> common_pb2.GenerationStats:
    # no speculative step: acceptance_length 0 (none)
    return common_pb2.GenerationStats(prompt_tokens=2, generated_tokens=3, steps=2, mode_run=common_pb2.DECODE_MODE_AR,
                                      verify_seconds=0.2, ar_steps=2, committed_per_step=[1, 1],
                                      fallback_reason=reason)


def _value(m: SpecDecodeMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_observe_counts_like_vllm():
    m = SpecDecodeMetrics()
    m.observe(_spec_stats())
    m.observe(_ar_stats("drafter propose failed (UNAVAILABLE: connection refused); continued target-only"))
    assert _value(m, "dspark:spec_decode_num_drafts_total") == 3
    assert _value(m, "dspark:spec_decode_num_draft_tokens_total") == 8
    assert _value(m, "dspark:spec_decode_num_accepted_tokens_total") == 4
    per_pos = [_value(m, "dspark:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert per_pos == [2, 2, 0, None]
    assert _value(m, "dspark:spec_decode_mean_acceptance_length") == pytest.approx(1 + 4 / 3)
    assert _value(m, "dspark:spec_decode_num_accepted_tokens_by_proposer_total", proposer="ngram") == 1
    assert _value(m, "dspark:steps_total", kind="ar") == 3
    assert _value(m, "dspark:steps_total", kind="speculative") == 3
    assert _value(m, "dspark:step_seconds_total", kind="verify") == pytest.approx(1.0)
    assert _value(m, "dspark:step_seconds_total", kind="draft") == pytest.approx(0.3)
    assert _value(m, "dspark:mean_step_seconds_count", kind="verify") == 2
    assert _value(m, "dspark:mean_step_seconds_sum", kind="verify") == pytest.approx(0.2 + 0.1)
    assert _value(m, "dspark:mean_step_seconds_sum", kind="draft") == pytest.approx(0.1)
    assert _value(m, "dspark:tokens_per_step_count") == 6
    assert _value(m, "dspark:tokens_per_step_sum") == 10
    assert _value(m, "dspark:tokens_per_step_bucket", le="1.0") == 4
    assert _value(m, "dspark:request_acceptance_length_sum") == 2.0  # the AR request has none
    assert _value(m, "dspark:request_acceptance_length_count") == 1
    assert _value(m, "dspark:requests_total", mode="speculation") == 1
    assert _value(m, "dspark:requests_total", mode="ar") == 1
    assert _value(m, "dspark:spec_decode_fallbacks_total", reason="drafter_propose_failed") == 1
    assert _value(m, "dspark:generation_tokens_total") == 12
    assert _value(m, "dspark:prompt_tokens_total") == 7
    s = m.summary()
    assert s["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert s["per_position_acceptance"] == pytest.approx([2 / 3, 2 / 3, 0])
    assert s["draft_acceptance_rate"] == pytest.approx(0.5)


def test_registries_are_private_and_labels_bounded():
    a, b = SpecDecodeMetrics(), SpecDecodeMetrics(max_reasons=2)
    a.observe(_spec_stats())
    assert _value(b, "dspark:spec_decode_num_drafts_total") == 0
    for reason in ("low_acceptance", "drafter timeout: 10 s", "third reason", "fourth reason"):
        b.observe(_ar_stats(reason))
    assert _value(b, "dspark:spec_decode_fallbacks_total", reason="low_acceptance") == 1
    assert _value(b, "dspark:spec_decode_fallbacks_total", reason="drafter_timeout") == 1
    assert _value(b, "dspark:spec_decode_fallbacks_total", reason="other") == 2
    assert reason_label("") == "unknown" and reason_label("X" * 100) == "x" * 48
    assert b"\nvllm:spec_decode_num_drafts_total 0.0\n" in SpecDecodeMetrics(prefix="vllm").exposition()


def test_exposition_names():
    m = SpecDecodeMetrics()
    m.observe(_spec_stats())
    text = m.exposition().decode()
    for name in ("dspark:spec_decode_num_drafts_total", "dspark:spec_decode_num_draft_tokens_total",
                 "dspark:spec_decode_num_accepted_tokens_total",
                 'dspark:spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "dspark:spec_decode_mean_acceptance_length", "dspark:tokens_per_step_bucket",
                 'dspark:mean_step_seconds_bucket{kind="draft"', 'dspark:requests_total{mode="speculation"}'):
        assert name in text, name
    assert text == prometheus_client.generate_latest(m.registry).decode()


def test_metrics_http_server():
    m = SpecDecodeMetrics()
    m.observe(_spec_stats())
    server = m.serve(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=60) as r:
            body = r.read().decode()
        assert "dspark:spec_decode_num_drafts_total 3.0" in body
    finally:
        server.shutdown()
        server.server_close()
    other = start_metrics_server(0, registry=prometheus_client.CollectorRegistry())
    other.shutdown()
    other.server_close()


def test_sdk_works_without_prometheus_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match="pip install prometheus-client"):
        SpecDecodeMetrics()


def test_metrics_module_is_torch_free():
    code = ("import sys, dspark_grpc.speculation.metrics; "
            "print(sorted(m for m in ('torch', 'numpy', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_step_metrics_count_the_planners_choices_and_draft_ahead():
    from dspark_grpc.protos.dspark.v1 import target_pb2

    m = SpecDecodeMetrics()
    m.observe_step(target_pb2.StepReport(draft_depth=3, draft_ready=True), drafted_ahead=True)
    m.observe_step(target_pb2.StepReport(draft_depth=2), drafted_ahead=True)
    m.observe_step(target_pb2.StepReport(planned_ar=True), drafted_ahead=False)
    m.observe_step(target_pb2.StepReport(draft_seconds=0.01), drafted_ahead=False)  # drafted, cut to nothing
    assert _value(m, "dspark:step_choices_total", choice="draft") == 2
    assert _value(m, "dspark:step_choices_total", choice="planned_ar") == 1
    assert _value(m, "dspark:step_choices_total", choice="cut_to_ar") == 1
    assert _value(m, "dspark:verified_draft_depth_sum") == 5
    assert _value(m, "dspark:draft_ahead_total", outcome="ready") == 1
    assert _value(m, "dspark:draft_ahead_total", outcome="late") == 1


def test_the_adaptive_choosers_view_is_exported_per_load():
    from dspark_grpc.speculation.mode_chooser import AR, SPECULATE, ModeChooser

    chooser = ModeChooser()
    chooser.observe(SPECULATE, 1, 3, 0.06, accepted=2, rows=4)
    chooser.observe(AR, 1, 1, 0.05)
    chooser.choose(1)
    m = SpecDecodeMetrics()
    m.watch_adaptive(chooser.summary)
    assert _value(m, "dspark:adaptive", load="1", value="speculation") == pytest.approx(50.0)
    assert _value(m, "dspark:adaptive", load="1", value="ar") == pytest.approx(20.0)
    assert _value(m, "dspark:adaptive", load="1", value="measured_speedup") == pytest.approx(2.5)
    assert _value(m, "dspark:adaptive", load="1", value="speculating") == 1.0
    chooser.observe(AR, 2, 1, 0.04)  # read at the scrape: what the chooser saw since is there
    assert _value(m, "dspark:adaptive", load="2", value="ar") == pytest.approx(25.0)
