"""A cancel/close/deadline storm: 16 clients x 10 requests that walk away in every way a caller can (the SDK's
deadline, breaking out of a stream, closing the client mid-request, asyncio cancellation, a Generate RPC's
deadline or cancel). Every call returns within its deadline (or the moment it was abandoned) + 2 s, no session is
left on either service (GetModelInfo / GetDrafterInfo and /metrics), and a normal request afterwards is AR's."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from dspark_grpc.client import AsyncTargetClient, TargetClient
from dspark_grpc.client.generation import RequestError
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc

from tests.reliability.conftest import MAX_SESSIONS, Service, draft_args, live_sessions, rss_mb, service, wait_until
from tests.reliability.lifecycle_helpers import PROMPTS

CLIENTS, REQUESTS = 16, 10
DEADLINE = 0.5  # seconds: shorter than any request of 200 tokens, so every deadline kind fires
SLACK = 2.0  # a call must return within its deadline (or the moment it was abandoned) + this
# What an abandoned call may end with: deadline, cancelled, or no free session while others are being freed
ENDINGS = {"ok", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED", "abandoned"}


def _metrics_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_ports() -> tuple[int, int]:
    return _metrics_port(), _metrics_port()


@pytest.fixture(scope="module")
def drafter(metrics_ports) -> Iterator[Service]:
    with service("draft", [*draft_args(), "--metrics-port", str(metrics_ports[1])]) as s:
        yield s


@pytest.fixture(scope="module")
def target(drafter: Service, metrics_ports) -> Iterator[Service]:
    args = ["--drafter", drafter.address, "--max-sessions", str(MAX_SESSIONS), "--metrics-port", str(metrics_ports[0])]
    with service("target", args) as s:
        yield s


def _gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _code(e: BaseException) -> str:
    if isinstance(e, RequestError):
        return {1: "CANCELLED", 4: "DEADLINE_EXCEEDED", 8: "RESOURCE_EXHAUSTED"}.get(e.code, f"code {e.code}: {e}")
    if isinstance(e, grpc.RpcError):
        return e.code().name
    return f"{type(e).__name__}: {e}"


class Storm:
    def __init__(self, target: Service, drafter: Service) -> None:
        self.target, self.drafter = target, drafter
        self.results: list[tuple[str, str, float]] = []  # (kind, ending, seconds past its bound)
        self.lock = threading.Lock()

    def record(self, kind: str, ending: str, late: float) -> None:
        with self.lock:
            self.results.append((kind, ending, late))

    def client(self, **kwargs) -> TargetClient:
        return TargetClient(self.target.address, drafter=self.drafter.address, draft_timeout=5, **kwargs)

    def run_client(self, i: int) -> None:
        client = self.client(timeout=60)
        for j in range(REQUESTS):
            kind = ("sdk_deadline", "sdk_break", "sdk_close", "aio_cancel", "rpc_deadline", "rpc_cancel")[(i + j) % 6]
            prompt, t0 = PROMPTS[(i + j) % len(PROMPTS)], time.monotonic()
            try:
                if kind == "sdk_deadline":
                    with self.client(timeout=DEADLINE) as c:
                        c.generate(prompt, max_new_tokens=200, ignore_eos=True, mode="speculation")
                    self.record(kind, "ok", time.monotonic() - t0 - DEADLINE)
                elif kind == "sdk_break":
                    steps = client.stream(prompt, max_new_tokens=200, ignore_eos=True, mode="speculation")
                    next(steps)
                    t_quit = time.monotonic()
                    steps.close()
                    self.record(kind, "abandoned", time.monotonic() - t_quit)
                elif kind == "sdk_close":
                    steps = client.stream(prompt, max_new_tokens=200, ignore_eos=True, mode="speculation")
                    next(steps)
                    t_quit = time.monotonic()
                    threading.Thread(target=client.close, daemon=True).start()
                    try:
                        for _ in steps:
                            pass
                        ending = "ok"
                    except (RequestError, grpc.RpcError) as e:
                        ending = _code(e)
                    self.record(kind, ending, time.monotonic() - t_quit)
                    client = self.client(timeout=60)
                elif kind == "aio_cancel":
                    async def cancelled(prompt: str = prompt) -> None:
                        async with AsyncTargetClient(self.target.address, drafter=self.drafter.address,
                                                     draft_timeout=5, timeout=60) as c:
                            await asyncio.wait_for(c.generate(prompt, max_new_tokens=200, ignore_eos=True,
                                                              mode="speculation"), DEADLINE)
                    try:
                        asyncio.run(cancelled())
                        ending = "ok"
                    except TimeoutError:
                        ending = "CANCELLED"
                    self.record(kind, ending, time.monotonic() - t0 - DEADLINE)
                else:
                    with grpc.insecure_channel(self.target.address) as channel:
                        request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=prompt), max_new_tokens=200,
                                                             ignore_eos=True, mode=common_pb2.DECODE_MODE_SPECULATION)
                        stub = target_pb2_grpc.TargetServiceStub(channel)
                        if kind == "rpc_deadline":
                            for _ in stub.Generate(request, timeout=DEADLINE):
                                pass
                            self.record(kind, "ok", time.monotonic() - t0 - DEADLINE)
                        else:
                            call = stub.Generate(request, timeout=60)
                            next(call)
                            t_quit = time.monotonic()
                            call.cancel()
                            self.record(kind, "abandoned", time.monotonic() - t_quit)
            except (RequestError, grpc.RpcError) as e:
                self.record(kind, _code(e), time.monotonic() - t0 - DEADLINE)
        client.close()


def test_cancel_close_deadline_storm_leaves_no_session(target, drafter, metrics_ports):
    with TargetClient(target.address) as ar:
        reference = ar.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True, mode="ar").token_ids
    rss0 = rss_mb(target.pid), rss_mb(drafter.pid)
    storm = Storm(target, drafter)
    t0 = time.monotonic()
    threads = [threading.Thread(target=storm.run_client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 600  # a bound on the whole storm: only a hang gets near it
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    assert not [t for t in threads if t.is_alive()], "a storm client hung"
    storm_seconds = time.monotonic() - t0

    assert len(storm.results) == CLIENTS * REQUESTS
    assert {e for _, e, _ in storm.results} <= ENDINGS, sorted({e for _, e, _ in storm.results} - ENDINGS)
    late = [(k, e, round(s, 2)) for k, e, s in storm.results if s > SLACK]
    assert not late, f"calls that returned more than {SLACK:g} s past their deadline: {late}"
    freed = wait_until(lambda: live_sessions(target.address, drafter.address) == (0, 0), 60,
                       "every session freed on both services")
    assert _gauge(metrics_ports[0], "dspark:target_live_sessions") == 0
    assert _gauge(metrics_ports[1], "dspark:draft_live_sessions") == 0

    with TargetClient(target.address, drafter=drafter.address) as client:
        after = client.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True, mode="speculation")
    assert after.token_ids == reference and after.stats.speculative_steps > 0
    rss1 = rss_mb(target.pid), rss_mb(drafter.pid)
    by_kind: dict[str, list[float]] = {}
    for k, _, s in storm.results:
        by_kind.setdefault(k, []).append(s)
    print(f"\nstorm: {CLIENTS}x{REQUESTS} calls in {storm_seconds:.1f} s; latest return past the bound by kind: "
          + ", ".join(f"{k} {max(v):+.2f} s" for k, v in sorted(by_kind.items()))
          + f"; endings {Counter(e for _, e, _ in storm.results)}; sessions 0 on both {freed:.2f} s after; "
          f"RSS target {rss0[0]:.0f} -> {rss1[0]:.0f} MiB, drafter {rss0[1]:.0f} -> {rss1[1]:.0f} MiB")
