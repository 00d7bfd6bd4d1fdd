"""Prometheus metrics of the services' own work (speculation/metrics.py has the per-request spec-decode ones).

- `ForwardMetrics(model)`: batched forwards of one model, `observe_forward(sessions, rows, seconds)` once per
  forward: histograms `<p>:<model>_forward_seconds`, `<p>:<model>_forward_rows` and
  `<p>:<model>_forward_sessions` (sessions that shared the forward). The target service uses model "target";
  the draft service "drafter" (one drafter pass, rows = sessions x block size).
- `DraftServiceMetrics`: the drafter's forwards plus, per proposal, by proposer (dspark, ngram, hybrid) and
  kind (chain, tree): `<p>:draft_proposals_total`, `<p>:draft_proposed_tokens_total` (nodes below the root)
  and the histogram `<p>:draft_proposal_seconds` (compute time of the proposal, waiting for its pass included).

- `live_sessions_gauge(registry, service, count)`: `<p>:<service>_live_sessions`, the sessions open now (read at
  each scrape), on the target ("target") and the draft service ("draft").
- `forward_threads_gauge(registry, model, threads)`: `<p>:<model>_forward_threads`, the threads the model's
  forwards run on now (serving/threads.py: one while that measures faster).

Each instance has its own CollectorRegistry (or shares one passed in, e.g. a SpecDecodeMetrics' registry, so one
/metrics endpoint serves both). prometheus-client is imported only when an instance is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dspark_grpc.speculation.metrics import SECONDS_BUCKETS, TOKEN_BUCKETS, _prometheus, start_metrics_server

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SESSION_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class _Metrics:
    def __init__(self, registry: Any = None) -> None:
        self.registry = registry if registry is not None else _prometheus().CollectorRegistry()

    def exposition(self) -> bytes:
        """The Prometheus text format of this registry (what /metrics serves)."""
        return _prometheus().generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1"):
        """Serve this registry at http://addr:port/metrics (0 = a free port: the returned server's
        `server_port`)."""
        return start_metrics_server(port, addr, self.registry)


def live_sessions_gauge(registry: Any, service: str, count: Callable[[], int], prefix: str = "dspark") -> None:
    _read_at_scrape(registry, f"{prefix}:{service}_live_sessions", f"Sessions open now on the {service} service.",
                    count)


def forward_threads_gauge(registry: Any, model: str, threads: Callable[[], int], prefix: str = "dspark") -> None:
    _read_at_scrape(registry, f"{prefix}:{model}_forward_threads", f"Threads the {model}'s forwards run on now.",
                    threads)


def _read_at_scrape(registry: Any, name: str, doc: str, value: Callable[[], int]) -> None:
    _prometheus().Gauge(name, doc, registry=registry).set_function(value)


class ForwardMetrics(_Metrics):
    """Batched forwards of one model ("target", "drafter"). Thread-safe."""

    def __init__(self, model: str, prefix: str = "dspark", registry: Any = None) -> None:
        super().__init__(registry)
        prom, r, name = _prometheus(), self.registry, f"{prefix}:{model}_forward"
        self.seconds = prom.Histogram(f"{name}_seconds", f"Seconds per {model} forward (batched).",
                                      buckets=SECONDS_BUCKETS, registry=r)
        self.rows = prom.Histogram(f"{name}_rows", f"Rows per {model} forward, all sessions together.",
                                   buckets=ROW_BUCKETS, registry=r)
        self.sessions = prom.Histogram(f"{name}_sessions", f"Sessions that shared one {model} forward.",
                                       buckets=SESSION_BUCKETS, registry=r)

    def observe_forward(self, sessions: int, rows: int, seconds: float) -> None:
        self.seconds.observe(seconds)
        self.rows.observe(rows)
        self.sessions.observe(sessions)


class DraftServiceMetrics(_Metrics):
    """The draft service's metrics: proposals, and the drafter passes they shared. Thread-safe."""

    def __init__(self, prefix: str = "dspark", registry: Any = None) -> None:
        super().__init__(registry)
        prom, r, p = _prometheus(), self.registry, prefix
        labels = ["proposer", "kind"]
        self.proposals = prom.Counter(f"{p}:draft_proposals", "Proposals made, by proposer and kind.", labels,
                                      registry=r)
        self.proposed_tokens = prom.Counter(f"{p}:draft_proposed_tokens",
                                            "Draft tokens proposed (tree nodes below the root).", labels, registry=r)
        self.proposal_seconds = prom.Histogram(f"{p}:draft_proposal_seconds", "Compute seconds per proposal.",
                                               labels, buckets=SECONDS_BUCKETS, registry=r)
        self.proposal_tokens = prom.Histogram(f"{p}:draft_proposal_tokens", "Draft tokens per proposal.", labels,
                                              buckets=TOKEN_BUCKETS, registry=r)
        self.drafter = ForwardMetrics("drafter", prefix, registry=r)

    def observe_proposal(self, proposer: str, kind: str, tokens: int, seconds: float) -> None:
        labels = dict(proposer=proposer or "unknown", kind=kind)
        self.proposals.labels(**labels).inc()
        self.proposed_tokens.labels(**labels).inc(tokens)
        self.proposal_tokens.labels(**labels).observe(tokens)
        self.proposal_seconds.labels(**labels).observe(seconds)

    def observe_forward(self, sessions: int, rows: int, seconds: float) -> None:
        """One drafter pass shared by `sessions` proposals."""
        self.drafter.observe_forward(sessions, rows, seconds)
