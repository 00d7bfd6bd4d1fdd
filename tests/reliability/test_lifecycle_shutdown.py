"""Stopping the target under speculative load with SIGTERM: it drains (health answers NOT_SERVING meanwhile, new
calls are refused with UNAVAILABLE, neither an open health Watch nor the target's own stream to its drafter holds
the exit); calls still running at the grace period's end get a clear status, and the drafter frees the sessions the
target held there. Nothing hangs. Each test stops its own target, started with the module's drafter (SIGKILL:
test_lifecycle.py)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
from dspark_grpc.client import TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.speculation.channel import SessionStream
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reliability.conftest import HANG_S, Service, drafter_info, health, service, wait_until
from tests.reliability.lifecycle_helpers import join_all, start_load

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def _exit_seconds(proc, t0: float, bound: float, since: str = "SIGTERM") -> float:
    try:
        proc.wait(bound)
    except Exception:  # noqa: BLE001 - TimeoutExpired: reported as the failure
        raise AssertionError(f"the target did not exit within {bound:g} s of {since}") from None
    return time.monotonic() - t0


def _drafting(drafter: Service) -> None:
    """Wait until the target drafts for the load (its draft sessions are open on the drafter)."""
    wait_until(lambda: drafter_info(drafter.address).live_sessions > 0, HANG_S, "the target's sessions drafting")


def _drafter_freed(drafter: Service) -> None:
    wait_until(lambda: drafter_info(drafter.address).live_sessions == 0, HANG_S,
               "the drafter freed the stopped target's sessions")


def test_sigterm_drains_serves_health_and_a_watch_does_not_hold_it(drafter: Service):
    grace = 600.0  # far past HANG_S: a target held to the grace period's end fails the exit's bound below
    with service("target", ["--grace", str(grace), "--drafter", drafter.address]) as target:
        watched: list[int] = []
        watch_channel = grpc.insecure_channel(target.address)
        watch = health_pb2_grpc.HealthStub(watch_channel).Watch(health_pb2.HealthCheckRequest(), timeout=grace * 2)
        threading.Thread(target=lambda: [watched.append(r.status) for r in _safe(watch)], daemon=True).start()
        # a session stream the test holds open: the drain lasts until the test ends it (no race with request speed)
        held_channel = grpc.insecure_channel(target.address)
        held = SessionStream(target_pb2_grpc.TargetServiceStub(held_channel).TargetSession, timeout=grace * 2)
        sid = _ok(held, 1, open=target_pb2.OpenSession()).opened.session_id
        pre = _ok(held, 2, prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Hello"))).prefilled
        clients = [TargetClient(target.address, timeout=300) for _ in range(2)]
        outcomes, threads = start_load(target.address, clients, max_new_tokens=24, mode="speculation")

        t_term = time.monotonic()
        target.process.send_signal(signal.SIGTERM)
        # health keeps answering during the grace period, with NOT_SERVING; a new call is refused with UNAVAILABLE
        wait_until(lambda: health(target.address) == NOT_SERVING, HANG_S, "health NOT_SERVING after SIGTERM")
        with grpc.insecure_channel(target.address) as channel:
            try:
                target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(target_pb2.GetModelInfoRequest(),
                                                                         timeout=HANG_S)
                raise AssertionError("a new call was accepted while draining")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        # calls under way go on: the held stream still verifies, the load finishes
        tree = common_pb2.TokenTree(tokens=[pre.next_token], parents=[-1])
        assert _ok(held, 3, verify=target_pb2.Verify(session_id=sid, tree=tree, commit=True)).verified.committed
        hung = join_all(threads, HANG_S)
        assert not hung, f"calls {hung} never returned: {[len(o.token_ids) for o in outcomes]} tokens"
        assert all(o.code == 0 for o in outcomes), [(o.code, o.message) for o in outcomes]
        assert [len(o.token_ids) for o in outcomes] == [24] * len(outcomes)
        # the draining target kept drafting with its drafter
        assert all(o.stats.speculative_steps > 0 for o in outcomes), [o.stats.fallback_reason for o in outcomes]
        assert target.process.poll() is None, "the target exited while a stream was still open"

        held.close()
        t_last = time.monotonic()
        # the Watch did not keep the server up until the grace period's end: it exits once the last call ended
        exited = _exit_seconds(target.process, t_last, HANG_S, "the last call's end") + t_last - t_term
        assert NOT_SERVING in watched
        _drafter_freed(drafter)
        print(f"\nSIGTERM drain: last call ended {t_last - t_term:.2f} s, exit {exited:.2f} s after SIGTERM "
              f"(grace {grace:g} s, a health Watch open)")
        for c in clients:
            c.close()
        held_channel.close()
        watch_channel.close()


def test_sigterm_past_the_grace_period_ends_every_call_with_a_status(drafter: Service):
    grace = 2.0
    with service("target", ["--grace", str(grace), "--drafter", drafter.address]) as target:
        clients = [TargetClient(target.address, timeout=300) for _ in range(4)]
        outcomes, threads = start_load(target.address, clients, max_new_tokens=4000, mode="speculation")
        _drafting(drafter)
        t_term = time.monotonic()
        target.process.send_signal(signal.SIGTERM)
        hung = join_all(threads, grace + HANG_S)
        assert not hung, f"calls {hung} still running {grace + HANG_S:g} s after SIGTERM"
        exited = _exit_seconds(target.process, t_term, grace + HANG_S)
        codes = [o.code for o in outcomes]
        # the server ends them itself, with a status that says why (not a cancelled stream)
        assert codes == [UNAVAILABLE] * len(outcomes), [(o.code, o.message) for o in outcomes]
        assert all("grace period" in o.message for o in outcomes), [o.message for o in outcomes]
        ends = [o.t_end - t_term for o in outcomes]
        _drafter_freed(drafter)
        print(f"\nSIGTERM, grace {grace:g} s: calls ended {min(ends):.2f}-{max(ends):.2f} s after it, codes "
              f"{sorted(set(codes))}, exit {exited:.2f} s")
        for c in clients:
            c.close()


def _safe(stream):
    try:
        yield from stream
    except grpc.RpcError:
        return


def _ok(stream: SessionStream, request_id: int, **op) -> target_pb2.TargetSessionResponse:
    response = stream.call(target_pb2.TargetSessionRequest(request_id=request_id, **op), timeout=120)
    assert response.status.code == 0, response.status.message
    return response
