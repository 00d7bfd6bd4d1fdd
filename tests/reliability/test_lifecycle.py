"""Faults under load, on one pair of services (tests run in file order; the last one kills the target):

- a cancel/close/deadline storm: 16 clients x 10 requests that walk away in every way a caller can (the SDK's
  deadline, breaking out of a stream, closing the client mid-request, asyncio cancellation, a Generate RPC's
  deadline or cancel), all speculating through the target's drafter. Every call ends the way its caller ended it
  (its deadline's status, CANCELLED, or abandoned; none runs to its end: the target finishes none of them), no
  session is left on either service (GetModelInfo / GetDrafterInfo and /metrics), and a normal request afterwards is
  AR's;
- the drafter stalled (SIGSTOP) or killed (SIGKILL) under 8 concurrent speculative requests (6 Generate calls, 2 SDK
  streams: both run the same loop of Steps, the target drafting with its own drafter): every request finishes with
  AR's tokens, AR requests never wait on the drafter, sessions are freed, and the target speculates again soon after
  the drafter is back. The target runs with `--draft-timeout 0` (no bound per drafter round): requests under way
  when the drafter stalls can then only finish because the target's health probe of the drafter drops it, which is
  what is tested (that it speculates again soon, rather than at all, rests on the channels' reconnect backoff:
  tests/test_keepalive.py);
- the target killed (SIGKILL) under load: every Generate and SDK call ends with UNAVAILABLE (not hung).
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from dspark_grpc.client import AsyncTargetClient, TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.speculation.generation import RequestError

from tests.reliability.conftest import (
    HANG_S,
    Service,
    draft_args,
    free_port,
    live_sessions,
    rss_mb,
    service,
    wait_until,
)
from tests.reliability.lifecycle_helpers import (
    PROMPTS,
    Outcome,
    generate_rpc,
    join_all,
    run_all,
    sdk_stream,
    start_load,
)

CLIENTS, REQUESTS = 16, 10
# room for a client's next request while the server still frees the sessions of the one it abandoned
STORM_SESSIONS = 2 * CLIENTS
DEADLINE = 0.5  # seconds: shorter than any request of 200 tokens, so every deadline kind fires
# How each kind of call ends: by its deadline's status, by its caller's cancel, abandoned (the caller walked away and
# got control back), or with no free session while others are being freed. Never "ok": that call ran to its end.
ENDINGS = {"sdk_deadline": "DEADLINE_EXCEEDED", "rpc_deadline": "DEADLINE_EXCEEDED", "aio_cancel": "CANCELLED",
           "sdk_close": "CANCELLED", "sdk_break": "abandoned", "rpc_cancel": "abandoned"}
TOKENS = 48  # long enough that every request is still running when the drafter stops or dies
AR, SPECULATION = common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
BOUND = 180.0  # seconds: only catches a hang (a request waiting on the stopped drafter for good)


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return dict(draft=free_port(), target_metrics=free_port(), draft_metrics=free_port())


@pytest.fixture(scope="module")
def drafter(ports) -> Iterator[Service]:
    args = [*draft_args(), "--max-sessions", str(STORM_SESSIONS), "--metrics-port", str(ports["draft_metrics"])]
    with service("draft", args, port=ports["draft"]) as s:
        yield s


@pytest.fixture(scope="module")
def target(drafter: Service, ports) -> Iterator[Service]:
    args = ["--drafter", drafter.address, "--draft-timeout", "0", "--max-sessions", str(STORM_SESSIONS),
            "--metrics-port", str(ports["target_metrics"])]
    with service("target", args) as s:
        yield s


def _gauge(port: int, name: str, labelled: bool = False) -> float:
    """A metric's value; summed over its label sets when it has labels (0 before the first one exists)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HANG_S).read().decode()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values or labelled, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def _code(e: BaseException) -> str:
    if isinstance(e, RequestError):
        return {1: "CANCELLED", 4: "DEADLINE_EXCEEDED", 8: "RESOURCE_EXHAUSTED"}.get(e.code, f"code {e.code}: {e}")
    if isinstance(e, grpc.RpcError):
        return e.code().name
    return f"{type(e).__name__}: {e}"


class Storm:
    def __init__(self, target: Service, drafter: Service) -> None:
        self.target, self.drafter = target, drafter
        self.results: list[tuple[str, str, float]] = []  # (kind, ending, seconds past its deadline or its quitting)
        self.lock = threading.Lock()

    def record(self, kind: str, ending: str, late: float) -> None:
        with self.lock:
            self.results.append((kind, ending, late))

    def client(self, **kwargs) -> TargetClient:
        return TargetClient(self.target.address, **kwargs)

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
                    next(steps)  # after a Step: the target has drafted for this session
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
                        async with AsyncTargetClient(self.target.address, timeout=60) as c:
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
                            next(call)  # after a Step: the target has drafted for this request
                            t_quit = time.monotonic()
                            call.cancel()
                            self.record(kind, "abandoned", time.monotonic() - t_quit)
            except (RequestError, grpc.RpcError) as e:
                self.record(kind, _code(e), time.monotonic() - t0 - DEADLINE)
        client.close()


def test_cancel_close_deadline_storm_leaves_no_session(target, drafter, ports):
    with TargetClient(target.address) as ar:
        reference = ar.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True, mode="ar").token_ids
    rss0 = rss_mb(target.pid), rss_mb(drafter.pid)
    proposals0 = _gauge(ports["draft_metrics"], "dspark:draft_proposals_total", labelled=True)
    finished0 = _gauge(ports["target_metrics"], "dspark:requests_total", labelled=True)
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
    proposals = _gauge(ports["draft_metrics"], "dspark:draft_proposals_total", labelled=True) - proposals0
    assert proposals > 0, "the storm's requests never reached the drafter"
    unlike = sorted({(k, e) for k, e, _ in storm.results if e not in (ENDINGS[k], "RESOURCE_EXHAUSTED")})
    assert not unlike, f"calls that did not end as their caller ended them: {unlike}"
    hung = [(k, e, round(s, 2)) for k, e, s in storm.results if s > HANG_S]
    assert not hung, f"calls that returned more than {HANG_S:g} s past their deadline or their quitting: {hung}"
    freed = wait_until(lambda: live_sessions(target.address, drafter.address) == (0, 0), HANG_S,
                       "every session freed on both services")
    # the target's own account: it finished none of the calls (a call that ran on after its caller left, or that its
    # caller waited out, would be counted here)
    finished = _gauge(ports["target_metrics"], "dspark:requests_total", labelled=True) - finished0
    assert finished == 0, f"the target ran {finished:g} of the storm's requests to their end"
    assert _gauge(ports["target_metrics"], "dspark:target_live_sessions") == 0
    assert _gauge(ports["draft_metrics"], "dspark:draft_live_sessions") == 0

    with TargetClient(target.address) as client:
        after = client.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True, mode="speculation")
    assert after.token_ids == reference and after.stats.speculative_steps > 0
    assert _gauge(ports["target_metrics"], "dspark:requests_total", labelled=True) - finished0 == 1  # (it counts)
    rss1 = rss_mb(target.pid), rss_mb(drafter.pid)
    by_kind: dict[str, list[float]] = {}
    for k, _, s in storm.results:
        by_kind.setdefault(k, []).append(s)
    print(f"\nstorm: {CLIENTS}x{REQUESTS} calls in {storm_seconds:.1f} s; latest return past the bound by kind: "
          + ", ".join(f"{k} {max(v):+.2f} s" for k, v in sorted(by_kind.items()))
          + f"; endings {Counter(e for _, e, _ in storm.results)}; {proposals:.0f} proposals drafted; sessions 0 on "
          f"both {freed:.2f} s after; "
          f"RSS target {rss0[0]:.0f} -> {rss1[0]:.0f} MiB, drafter {rss0[1]:.0f} -> {rss1[1]:.0f} MiB")


@pytest.fixture(scope="module")
def reference(target: Service) -> dict[str, list[int]]:
    """Greedy AR tokens of every prompt."""
    outcomes, threads = run_all([(generate_rpc, (target.address, p), dict(max_new_tokens=TOKENS, ignore_eos=True,
                                                                          mode=AR)) for p in PROMPTS])
    assert not join_all(threads, BOUND)
    assert all(o.code == 0 for o in outcomes), [o.message for o in outcomes]
    return {p: o.token_ids for p, o in zip(PROMPTS, outcomes, strict=True)}


def _speculate(target: Service, drafter: Service, clients: list[TargetClient]):
    """6 Generate calls and 2 SDK streams, all speculating; returns once each has its first tokens."""
    calls = [(generate_rpc, (target.address, p), dict(max_new_tokens=TOKENS, ignore_eos=True, mode=SPECULATION))
             for p in PROMPTS[:6]]
    calls += [(sdk_stream, (c, p), dict(max_new_tokens=TOKENS, ignore_eos=True, mode="speculation"))
              for c, p in zip(clients, PROMPTS[6:], strict=True)]
    outcomes, threads = run_all(calls)
    for out in outcomes:
        assert out.started.wait(BOUND)
    return outcomes, threads


def _check_identical(outcomes: list[Outcome], prompts: list[str], reference: dict[str, list[int]]) -> None:
    assert [o.code for o in outcomes] == [0] * len(outcomes), [(o.code, o.message) for o in outcomes]
    for o, p in zip(outcomes, prompts, strict=True):
        assert o.token_ids == reference[p][: len(o.token_ids)] and len(o.token_ids) == TOKENS, p


def _speculates(address: str) -> bool:
    out = Outcome()
    generate_rpc(address, PROMPTS[0], out, timeout=60, max_new_tokens=3, ignore_eos=True, mode=SPECULATION)
    return out.code == 0 and out.stats.speculative_steps > 0


def _ar_seconds(address: str) -> Outcome:
    out = run_all([(generate_rpc, (address, PROMPTS[1]), dict(max_new_tokens=16, ignore_eos=True, mode=AR))])
    assert not join_all(out[1], BOUND), "an AR request waited on the stopped drafter"
    return out[0][0]


def test_drafter_sigstop_costs_no_tokens_and_ar_never_waits(target, drafter, reference):
    clients = [TargetClient(target.address, timeout=300) for _ in range(2)]
    outcomes, threads = _speculate(target, drafter, clients)
    drafter.process.send_signal(signal.SIGSTOP)
    try:
        t_stop = time.monotonic()
        ar_stalled = _ar_seconds(target.address)  # joined while the drafter is still stopped
        assert ar_stalled.code == 0 and ar_stalled.token_ids == reference[PROMPTS[1]][:16]
        late = Outcome()  # a speculative request that starts while the drafter is stopped: target-only at once
        generate_rpc(target.address, PROMPTS[2], late, timeout=BOUND, max_new_tokens=8, ignore_eos=True,
                     mode=SPECULATION)
        assert late.code == 0 and late.token_ids == reference[PROMPTS[2]][:8]
        assert late.stats.speculative_steps == 0 and "drafter" in late.stats.fallback_reason
        hung = join_all(threads, BOUND)
        assert not hung, f"requests {hung} waited on the stopped drafter"
        t_done = time.monotonic()
        _check_identical(outcomes, PROMPTS, reference)
        assert all("drafter" in o.stats.fallback_reason for o in outcomes), [o.stats.fallback_reason
                                                                           for o in outcomes]
        wait_until(lambda: live_sessions(target.address)[0] == 0, HANG_S, "the target's sessions freed")
    finally:
        drafter.process.send_signal(signal.SIGCONT)
    resumed = wait_until(lambda: _speculates(target.address), HANG_S, "Generate speculates again", every=0.2)
    wait_until(lambda: live_sessions(target.address, drafter.address) == (0, 0), HANG_S, "sessions freed on both")
    print(f"\nSIGSTOP: an AR request (16 tokens) started at the stop took {ar_stalled.seconds:.2f} s (8 requests "
          f"under way, the drafter stopped); those 8 finished {t_done - t_stop:.2f} s after the stop; speculation "
          f"again {resumed:.2f} s after SIGCONT; why they stopped speculating: {outcomes[0].stats.fallback_reason}")
    for c in clients:
        c.close()


def test_drafter_sigkill_costs_no_tokens_and_speculation_resumes(target, drafter, ports, reference):
    clients = [TargetClient(target.address, timeout=300) for _ in range(2)]
    outcomes, threads = _speculate(target, drafter, clients)
    t_kill = time.monotonic()
    drafter.process.kill()
    hung = join_all(threads, BOUND)
    assert not hung, f"requests {hung} never finished after the drafter died"
    t_done = time.monotonic()
    _check_identical(outcomes, PROMPTS, reference)
    assert all("drafter" in o.stats.fallback_reason for o in outcomes), [o.stats.fallback_reason for o in outcomes]
    assert not _speculates(target.address)
    wait_until(lambda: live_sessions(target.address)[0] == 0, HANG_S, "the target's sessions freed")
    with service("draft", draft_args(), port=ports["draft"]) as back:  # the same address; returns once SERVING
        resumed = wait_until(lambda: _speculates(target.address), HANG_S, "Generate speculates again", every=0.2)
        again = run_all([(sdk_stream, (clients[0], PROMPTS[6]), dict(max_new_tokens=16, ignore_eos=True,
                                                                     mode="speculation"))])
        assert not join_all(again[1], BOUND)
        sdk = again[0][0]
        assert sdk.code == 0 and sdk.stats.speculative_steps > 0 and sdk.token_ids == reference[PROMPTS[6]][:16]
        wait_until(lambda: live_sessions(target.address, back.address) == (0, 0), HANG_S, "sessions freed on both")
    print(f"\nSIGKILL: 8 requests under way finished {t_done - t_kill:.2f} s after the kill, identical to AR; Generate "
          f"speculated again {resumed:.2f} s after the restarted drafter was SERVING")
    for c in clients:
        c.close()


def test_target_sigkill_ends_every_call_with_unavailable(target):  # last: the module's target dies here
    clients = [TargetClient(target.address, timeout=300) for _ in range(4)]
    outcomes, threads = start_load(target.address, clients, max_new_tokens=4000)
    t_kill = time.monotonic()
    target.process.kill()
    hung = join_all(threads, HANG_S)
    assert not hung, f"calls {hung} still running {HANG_S:g} s after SIGKILL"
    assert [o.code for o in outcomes] == [UNAVAILABLE] * len(outcomes), [(o.code, o.message) for o in outcomes]
    print(f"\ntarget SIGKILL: every call ended {max(o.t_end for o in outcomes) - t_kill:.2f} s after it, UNAVAILABLE")
    # a client of the dead target fails at once, the same way
    out = run_all([(sdk_stream, (clients[0], "Hi"), dict(max_new_tokens=4, mode="ar"))])
    assert not join_all(out[1], HANG_S)
    assert out[0][0].code == UNAVAILABLE
    for c in clients:
        c.close()
