"""The Generate RPC's link to its draft service: one channel, a health probe, the drafter's info.

A session drafts only while the probes find the drafter SERVING, so a dead or stalled drafter costs new sessions
nothing and AR steps never wait on it. When the drafter reports NOT_SERVING, or does not answer two probes in a row
(one late answer on a busy machine is not a stall), the draft stream (target_service/draft_rounds.py) is cancelled:
the sessions under way finish target-only (same tokens), a stall costing each of them at most two probe periods (or
the draft timeout, if shorter). The drafter is used again one probe interval after it is back.
"""

from __future__ import annotations

import os
import sys
import threading

import grpc
from dspark_grpc.protos.dspark.v1 import draft_pb2, draft_pb2_grpc
from dspark_grpc.speculation.channel import SessionStream, SocketSessionStream, tls_mismatch
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 2.0  # a drafter slower than this to answer a health check is treated as stalled
FAILED_PROBES_TO_DROP = 2


class DrafterLink:
    def __init__(self, channel: grpc.Channel, address: str, draft_timeout: float | None,
                 interval_s: float = PROBE_INTERVAL_S, probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.channel, self.address = channel, address
        self.stub = draft_pb2_grpc.DraftServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self.draft_timeout = draft_timeout or None  # 0 = no bound per call (the probe still catches a stall)
        self.interval_s, self.probe_timeout_s = interval_s, probe_timeout_s
        self.info: draft_pb2.GetDrafterInfoResponse | None = None  # None while the drafter is not SERVING
        self.down_reason = "not probed yet"
        self._failed = 0  # probes in a row without an answer
        self._streams: set[SessionStream] = set()
        self.use_session_socket = True  # the drafter's session socket when it offers one on this machine
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DrafterLink:
        self._thread = threading.Thread(target=self._run, name="drafter-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.probe()
            self._stop.wait(self.interval_s)

    def probe(self) -> bool:
        """One health check (and GetDrafterInfo when the drafter has come back); True while it is SERVING."""
        try:
            status = self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                self._down(f"drafter {self.address} reports {name}")
                return False
            info = self.info or self.stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(),
                                                         timeout=self.probe_timeout_s)
        except grpc.RpcError as e:
            self._failed += 1
            if self._failed >= FAILED_PROBES_TO_DROP or self.info is None:
                self._down(f"drafter {self.address} unavailable ({e.code().name}: {e.details()})")
            return False
        self._failed = 0
        with self._lock:
            self.info, self.down_reason = info, ""
        return True

    def unreachable(self) -> str | None:
        """One health check that changes nothing here (the probe thread keeps the link's state): None when the
        drafter answers (SERVING, or NOT_SERVING while it loads), else what a target says at start-up."""
        try:
            self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
        except grpc.RpcError as e:
            why = tls_mismatch(e.details() or "", "--drafter-tls-ca, --drafter-tls-cert/--drafter-tls-key") \
                or e.details()
            return (f"drafter {self.address} is not reachable ({e.code().name}: {why}): sessions run target-only "
                    "until it answers")
        return None

    def _down(self, reason: str) -> None:
        with self._lock:
            self.info, self.down_reason = None, reason
            streams, self._streams = self._streams, set()
        for s in streams:
            s.close(f"dropped: {reason}")

    def open_stream(self) -> SessionStream | None:
        """A DraftSession stream (no round trip), closed by the probe when the drafter goes down; None while it
        is down. On the drafter's session socket when it offers one that this machine has (the same messages, less
        latency), else over gRPC."""
        with self._lock:
            if self.info is None:
                return None
            path = self.info.session_socket if self.use_session_socket else ""
        stream = None
        if path and (path.startswith("@") or os.path.exists(path)):  # "@": abstract, found by connecting
            try:
                stream = SocketSessionStream(path, draft_pb2.DraftSessionResponse)
            except OSError:  # not on this machine, or a stale file: gRPC then
                stream = None
        with self._lock:
            if self.info is None:  # went down meanwhile
                if stream is not None:
                    stream.close("the drafter went down")
                return None
            stream = stream or SessionStream(self.stub.DraftSession, None)
            self._streams.add(stream)
            return stream


def warn_if_unreachable(link: DrafterLink, log_prefix: str) -> threading.Thread:
    """Says on stderr, once, if the drafter does not answer now; in a thread of its own (returned), so that a drafter
    that never answers delays nothing. The target starts and serves either way."""

    def check() -> None:
        if (warning := link.unreachable()) is not None:
            print(f"{log_prefix} warning: {warning}", file=sys.stderr, flush=True)

    thread = threading.Thread(target=check, name="drafter-first-check", daemon=True)
    thread.start()
    return thread
