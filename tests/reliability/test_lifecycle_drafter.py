"""A drafter stalled (SIGSTOP) or killed (SIGKILL) under 8 concurrent speculative requests: every request finishes
with AR's tokens, AR requests never wait on the drafter, sessions are freed, and Generate speculates again soon
after the drafter is back.

The target runs with `--draft-timeout 0` (no bound per drafter call): requests under way when the drafter stalls
can then only finish because the target's health probe of the drafter drops it, which is what is tested. The SDK
clients speculate with the drafter directly, with their own draft timeout."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator

import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2

from tests.reliability.conftest import Service, draft_args, live_sessions, service, wait_until
from tests.reliability.lifecycle_helpers import PROMPTS, Outcome, generate_rpc, join_all, run_all, sdk_stream

TOKENS = 48  # long enough that every request is still running when the drafter stops or dies
AR, SPECULATION = common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION
BOUND = 180.0  # seconds: only catches a hang (a request waiting on the stopped drafter for good)
RESUME_BOUND = 10.0  # seconds after the drafter is back: gRPC's default reconnect backoff took 19 s


@pytest.fixture(scope="module")
def draft_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def drafter(draft_port: int) -> Iterator[Service]:
    with service("draft", draft_args(), port=draft_port) as s:
        yield s


@pytest.fixture(scope="module")
def target(drafter: Service) -> Iterator[Service]:
    with service("target", ["--drafter", drafter.address, "--draft-timeout", "0", "--max-sessions", "16"]) as s:
        yield s


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
    out = run_all([(generate_rpc, (address, PROMPTS[1]), dict(max_new_tokens=32, ignore_eos=True, mode=AR))])
    assert not join_all(out[1], BOUND), "an AR request waited on the stopped drafter"
    return out[0][0]


def test_drafter_sigstop_costs_no_tokens_and_ar_never_waits(target, drafter, reference):
    ar_normal = _ar_seconds(target.address)
    clients = [TargetClient(target.address, drafter=drafter.address, draft_timeout=5, timeout=300)
               for _ in range(2)]
    outcomes, threads = _speculate(target, drafter, clients)
    drafter.process.send_signal(signal.SIGSTOP)
    try:
        t_stop = time.monotonic()
        ar_stalled = _ar_seconds(target.address)  # joined while the drafter is still stopped
        assert ar_stalled.code == 0 and ar_stalled.token_ids == reference[PROMPTS[1]][:32]
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
        wait_until(lambda: live_sessions(target.address)[0] == 0, 30, "the target's sessions freed")
    finally:
        drafter.process.send_signal(signal.SIGCONT)
    resumed = wait_until(lambda: _speculates(target.address), RESUME_BOUND, "Generate speculates again", every=0.2)
    wait_until(lambda: live_sessions(target.address, drafter.address) == (0, 0), 30, "sessions freed on both")
    print(f"\nSIGSTOP: AR request (32 tokens) {ar_normal.seconds:.2f} s normally, {ar_stalled.seconds:.2f} s with the "
          f"drafter stopped; 8 requests under way finished {t_done - t_stop:.2f} s after the stop; speculation "
          f"again {resumed:.2f} s after SIGCONT; why they stopped speculating: {outcomes[0].stats.fallback_reason}")
    for c in clients:
        c.close()


def test_drafter_sigkill_costs_no_tokens_and_speculation_resumes(target, drafter, draft_port, reference):
    clients = [TargetClient(target.address, drafter=drafter.address, draft_timeout=5, timeout=300)
               for _ in range(2)]
    outcomes, threads = _speculate(target, drafter, clients)
    t_kill = time.monotonic()
    drafter.process.kill()
    hung = join_all(threads, BOUND)
    assert not hung, f"requests {hung} never finished after the drafter died"
    t_done = time.monotonic()
    _check_identical(outcomes, PROMPTS, reference)
    assert all("drafter" in o.stats.fallback_reason for o in outcomes), [o.stats.fallback_reason for o in outcomes]
    assert not _speculates(target.address)
    wait_until(lambda: live_sessions(target.address)[0] == 0, 30, "the target's sessions freed")
    with service("draft", draft_args(), port=draft_port) as back:  # the same address; returns once SERVING
        resumed = wait_until(lambda: _speculates(target.address), RESUME_BOUND, "Generate speculates again",
                             every=0.2)
        again = run_all([(sdk_stream, (clients[0], PROMPTS[6]), dict(max_new_tokens=16, ignore_eos=True,
                                                                     mode="speculation"))])
        assert not join_all(again[1], BOUND)
        sdk = again[0][0]
        assert sdk.code == 0 and sdk.stats.speculative_steps > 0 and sdk.token_ids == reference[PROMPTS[6]][:16]
        wait_until(lambda: live_sessions(target.address, back.address) == (0, 0), 30, "sessions freed on both")
    print(f"\nSIGKILL: 8 requests under way finished {t_done - t_kill:.2f} s after the kill, identical to AR; Generate "
          f"speculated again {resumed:.2f} s after the restarted drafter was SERVING")
    for c in clients:
        c.close()
