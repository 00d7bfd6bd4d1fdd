"""Prometheus metrics for speculative decoding, folded from each finished request's GenerationStats.

Definitions follow vLLM's v1/spec_decode/metrics.py, under this project's prefix ("dspark" for "vllm"):

- `<p>:spec_decode_num_drafts_total`: drafts = target forwards that verified at least one draft token.
- `<p>:spec_decode_num_draft_tokens_total`: draft tokens; for a tree, a draft counts its depth (the tokens on
  its longest root-to-leaf path), so that per-position counts pool exactly.
- `<p>:spec_decode_num_accepted_tokens_total`: accepted draft tokens (the bonus token is not counted).
- `<p>:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`: drafts whose accepted path reached
  depth i + 1 (0-based positions, as vLLM).
  Per-position acceptance at i = per_pos[i] / num_drafts; mean acceptance length = 1 + accepted / drafts
  (exported as the gauge `<p>:spec_decode_mean_acceptance_length`, cumulative since start; for a window use
  1 + rate(accepted) / rate(drafts)).

Beyond vLLM: a histogram of tokens committed per target forward (bonus included; AR steps count 1), a histogram
of each request's acceptance length (the requests that speculated), steps by kind (ar / speculative), per-request
mean draft and verify seconds per step (histograms) with exact second totals (counters), accepted tokens by
proposer, requests by the decode mode actually run, and speculation fallbacks by reason.

prometheus-client is imported only when a `SpecDecodeMetrics` is built, so the SDK works without it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.speculation.wire import AR, MODE_NAMES
from google.protobuf import json_format

TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _prometheus():
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("metrics need prometheus-client: pip install prometheus-client==0.26.0") from e
    return prometheus_client


def mode_label(mode: int) -> str:
    """DECODE_MODE_SPECULATION -> "speculation"."""
    try:
        return common_pb2.DecodeMode.Name(mode).removeprefix("DECODE_MODE_").lower()
    except ValueError:
        return str(mode)


def stats_dict(stats: common_pb2.GenerationStats) -> dict:
    """A finished request's stats as JSON values, one shape for `dspark generate --json` and the HTTP API's `dspark`
    object: every field under its proto name, int64 fields as numbers (protobuf's JSON writes them as strings),
    mode_run as "ar" / "speculation", acceptance_length null where no step speculated."""
    out = json_format.MessageToDict(stats, always_print_fields_with_no_presence=True,
                                    preserving_proto_field_name=True, unquote_int64_if_possible=True)
    out["mode_run"] = MODE_NAMES.get(stats.mode_run, "")
    if not stats.speculative_steps:
        out["acceptance_length"] = None
    return out


def reason_label(reason: str) -> str:
    """A bounded label from a free-text fallback reason: the words before the first "(", ":" or ";",
    lower-cased, as snake_case, at most 48 characters ("drafter propose failed (UNAVAILABLE: ...)" ->
    "drafter_propose_failed"). Short codes pass through unchanged."""
    head = re.split(r"[(:;]", reason, maxsplit=1)[0]
    label = re.sub(r"[^a-z0-9]+", "_", head.lower()).strip("_")[:48].rstrip("_")
    return label or "unknown"


class SpecDecodeMetrics:
    """One set of metrics in its own CollectorRegistry. Thread-safe; `observe` once per finished request."""

    def __init__(self, prefix: str = "dspark", max_positions: int = 64, max_reasons: int = 32,
                 registry: Any = None) -> None:
        prom = _prometheus()
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self.prefix, self.max_positions, self.max_reasons = prefix, max_positions, max_reasons
        self._lock = threading.Lock()
        self._reasons: set[str] = set()
        # plain tallies behind the derived numbers (mean acceptance length, per-position acceptance)
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

        p, r = prefix, self.registry
        s = f"{p}:spec_decode_"
        self.num_drafts = prom.Counter(s + "num_drafts", "Number of spec decoding drafts.", registry=r)
        self.num_draft_tokens = prom.Counter(s + "num_draft_tokens", "Number of draft tokens.", registry=r)
        self.num_accepted_tokens = prom.Counter(s + "num_accepted_tokens", "Number of accepted tokens.",
                                                registry=r)
        self.num_accepted_tokens_per_pos = prom.Counter(
            s + "num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ["position"], registry=r)
        self.num_accepted_tokens_by_proposer = prom.Counter(
            s + "num_accepted_tokens_by_proposer", "Accepted tokens by the proposer that drafted them.",
            ["proposer"], registry=r)
        self.mean_acceptance_length = prom.Gauge(
            s + "mean_acceptance_length", "1 + accepted tokens / drafts, since start.", registry=r)
        self.tokens_per_step = prom.Histogram(
            f"{p}:tokens_per_step", "Tokens committed per target forward, bonus included (AR steps: 1).",
            buckets=TOKEN_BUCKETS, registry=r)
        self.request_acceptance_length = prom.Histogram(
            f"{p}:request_acceptance_length", "Per request that speculated: tokens committed per speculative step.",
            buckets=TOKEN_BUCKETS, registry=r)
        self.steps = prom.Counter(f"{p}:steps", "Target forwards after prefill, by kind (ar, speculative).",
                                  ["kind"], registry=r)
        self.step_seconds = prom.Counter(f"{p}:step_seconds", "Seconds spent in draft and verify calls.",
                                         ["kind"], registry=r)
        self.mean_step_seconds = prom.Histogram(
            f"{p}:mean_step_seconds", "Per request: mean seconds of a draft call (over speculative steps) and of "
            "a verify call (over all steps), as the caller sees them.", ["kind"], buckets=SECONDS_BUCKETS,
            registry=r)
        self.requests = prom.Counter(f"{p}:requests", "Finished requests by the decode mode run.", ["mode"],
                                     registry=r)
        self.fallbacks = prom.Counter(f"{p}:spec_decode_fallbacks", "Requests whose speculation was stopped or "
                                      "switched, by reason.", ["reason"], registry=r)
        # per step, as the target runs them (SDK Steps and Generate alike): the planner's choices, draft ahead
        self.step_choices = prom.Counter(f"{p}:step_choices", "Steps of drafting sessions by what ran: draft "
                                         "(verified a draft), planned_ar (the planner chose AR), cut_to_ar (the "
                                         "round planner cut the draft to nothing).", ["choice"], registry=r)
        self.verified_depth = prom.Histogram(f"{p}:verified_draft_depth", "Draft tokens verified per drafting step "
                                             "(the budget the planners chose).", buckets=TOKEN_BUCKETS, registry=r)
        self.draft_ahead = prom.Counter(f"{p}:draft_ahead", "Proposals drafted ahead, by whether they were ready "
                                        "when their step began (chain: the rest of the step before's chain, no "
                                        "round).", ["outcome"], registry=r)
        self.generation_tokens = prom.Counter(f"{p}:generation_tokens", "Generated tokens.", registry=r)
        self.prompt_tokens = prom.Counter(f"{p}:prompt_tokens", "Prompt tokens.", registry=r)

    def observe(self, stats: common_pb2.GenerationStats) -> None:
        """Fold one finished request's stats into the metrics."""
        drafted, accepted = list(stats.drafted_per_position), list(stats.accepted_per_position)
        n_drafts, n_draft_tokens, n_accepted = stats.speculative_steps, sum(drafted), sum(accepted)
        with self._lock:
            self.drafts += n_drafts
            self.draft_tokens += n_draft_tokens
            self.accepted_tokens += n_accepted
            self.accepted_per_pos.extend([0] * (len(accepted) - len(self.accepted_per_pos)))
            for i, a in enumerate(accepted):
                self.accepted_per_pos[i] += a
            if self.drafts:
                self.mean_acceptance_length.set(1 + self.accepted_tokens / self.drafts)
            reason = ""
            if stats.fallback_reason:
                reason = reason_label(stats.fallback_reason)
                if reason not in self._reasons:
                    if len(self._reasons) >= self.max_reasons:
                        reason = "other"
                    self._reasons.add(reason)

        self.num_drafts.inc(n_drafts)
        self.num_draft_tokens.inc(n_draft_tokens)
        self.num_accepted_tokens.inc(n_accepted)
        # every position drafted gets a series (0 accepted included), as vLLM's fixed k positions do
        for i in range(min(len(drafted), self.max_positions)):
            self.num_accepted_tokens_per_pos.labels(position=str(i)).inc(accepted[i] if i < len(accepted) else 0)
        for proposer, n in stats.accepted_by_proposer.items():
            self.num_accepted_tokens_by_proposer.labels(proposer=proposer or "unknown").inc(n)
        for n in stats.committed_per_step:
            self.tokens_per_step.observe(n)
        if stats.speculative_steps:  # an AR-only request has no acceptance length
            self.request_acceptance_length.observe(stats.acceptance_length)
        if stats.steps:
            self.mean_step_seconds.labels(kind="verify").observe(stats.verify_seconds / stats.steps)
        if n_drafts and stats.draft_seconds:
            self.mean_step_seconds.labels(kind="draft").observe(stats.draft_seconds / n_drafts)
        self.steps.labels(kind=AR).inc(stats.ar_steps)
        self.steps.labels(kind="speculative").inc(stats.speculative_steps)
        self.step_seconds.labels(kind="draft").inc(stats.draft_seconds)
        self.step_seconds.labels(kind="verify").inc(stats.verify_seconds)
        self.requests.labels(mode=mode_label(stats.mode_run)).inc()
        if reason:
            self.fallbacks.labels(reason=reason).inc()
        self.generation_tokens.inc(stats.generated_tokens)
        self.prompt_tokens.inc(stats.prompt_tokens)

    def observe_step(self, report: Any, drafted_ahead: bool) -> None:
        """One step of a drafting session (a target_pb2.StepReport), as the target ran it."""
        if report.draft_depth:
            self.step_choices.labels(choice="draft").inc()
            self.verified_depth.observe(report.draft_depth)
        elif report.planned_ar:
            self.step_choices.labels(choice="planned_ar").inc()
        elif report.draft_seconds:
            self.step_choices.labels(choice="cut_to_ar").inc()
        if drafted_ahead:
            outcome = ("chain" if report.draft_from_chain else "lookup" if report.draft_from_lookup
                       else "ready" if report.draft_ready else "late")
            self.draft_ahead.labels(outcome=outcome).inc()

    def watch_adaptive(self, summary: Callable[[], dict[int, dict[str, float | None]]]) -> None:
        """Export the adaptive mode's view (ModeChooser.summary), read at each scrape."""
        _prometheus()  # the clear error without prometheus-client
        from prometheus_client.core import GaugeMetricFamily

        name = f"{self.prefix}:adaptive"
        doc = ("The adaptive mode's view per load (sessions stepping, bucketed): measured tokens/s per session by "
               "arm (ar, speculation), speculation's measured and predicted speed-up over AR, and whether it "
               "speculates now (1/0).")

        class AdaptiveView:
            def collect(self):
                gauge = GaugeMetricFamily(name, doc, labels=["load", "value"])
                for load, values in summary().items():
                    for value_name, value in values.items():
                        if value is not None:
                            gauge.add_metric([str(load), value_name], value)
                yield gauge

        self.registry.register(AdaptiveView())

    def summary(self) -> dict[str, Any]:
        """The derived numbers, vLLM's way: mean acceptance length and per-position acceptance rates."""
        with self._lock:
            d = self.drafts
            return {
                "num_drafts": d,
                "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens,
                "mean_acceptance_length": 1 + self.accepted_tokens / d if d else None,
                "draft_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
                "per_position_acceptance": [a / d for a in self.accepted_per_pos] if d else [],
            }

    def exposition(self) -> bytes:
        """The Prometheus text format of this registry (what /metrics serves)."""
        return _prometheus().generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1"):
        return start_metrics_server(port, addr, self.registry)


def start_metrics_server(port: int, addr: str = "127.0.0.1", registry: Any = None):
    """Serve `registry` (default: prometheus-client's global one) at http://addr:port/metrics from a daemon
    thread. port 0 picks a free port: read it from the returned server's `server_port`; `shutdown()` stops it."""
    prom = _prometheus()
    server, _thread = prom.start_http_server(port, addr=addr, registry=registry or prom.REGISTRY)
    return server
