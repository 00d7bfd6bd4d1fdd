"""Fixtures that start the real target service as a child process on loopback."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_drafter, local_target
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.speculation.channel import SessionStream
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "dspark.v1.TargetService"
MAX_SESSIONS = 4
# The shared drafter: a target's worth of draft sessions (one principal, the target's link) and the reserve kept for
# principals that hold none (serving/sessions.py), as the draft service's defaults are laid out.
DRAFT_MAX_SESSIONS = MAX_SESSIONS + 1
MAX_MESSAGE_BYTES = 4 << 20
# Lossless tests assert that speculation ran without falling back: a drafter call on a busy CI machine (the fused
# kernel runs in Triton's interpreter here) must not hit the 10 s default and turn the request target-only.
SLOW_MACHINE_DRAFT_TIMEOUT = 300.0
# The bound of a wait for something the service does at once (an answer, a session freed): only a hang reaches it, on
# a machine ten times slower than a developer's too. Waits poll, so they end as soon as the condition holds.
HANG_S = 120.0


@pytest.fixture(scope="session")
def target_address() -> str:
    """The default model (embedded SmolLM2 GGUF) in the exact precision (the tests compare it with HF
    transformers), small limits so limit tests are cheap."""
    args = ["--max-sessions", str(MAX_SESSIONS), "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--quiet",
            "--no-cost-profile", "--precision", "exact"]
    with local_target(args, echo=False) as address:
        with TargetClient(address) as client:
            client.wait_ready(timeout=300)
        yield address


@pytest.fixture(scope="session")
def draft_address() -> str:
    """A seeded random drafter for the default target; the CPU Triton interpreter on, so 'fused' can run."""
    args = ["--drafter", "random", "--seed", "0", "--max-sessions", str(DRAFT_MAX_SESSIONS), "--quiet",
            "--no-cost-profile"]
    with local_drafter(args, echo=False, env={"TRITON_INTERPRET": "1"}) as address:
        with TargetClient(address) as probe:
            probe.wait_ready(timeout=300)
        yield address


@contextlib.contextmanager
def target_with_drafter(drafter: str, *args: str, draft_timeout: float = SLOW_MACHINE_DRAFT_TIMEOUT) -> Iterator[str]:
    """A target (the default model unless `args` name another) started with `--drafter DRAFTER`; yielded once it
    is SERVING and has found its drafter (`wait_drafting`)."""
    args = ["--drafter", drafter, "--draft-timeout", str(draft_timeout), "--quiet", "--no-cost-profile",
            "--precision", "exact", *args]  # the same precision as `target_address`, whose AR it is compared with
    with local_target(args, echo=False) as address:
        with TargetClient(address) as probe:
            probe.wait_ready(timeout=300)
        wait_drafting(address)
        yield address


def concurrently(function: Callable, items: Iterable) -> list:
    """`[function(item) for item in items]`, the calls made at once from threads (a target batches their forwards:
    one read of the weights for all of them, where the calls made one after the other read them once each). For
    requests whose results do not depend on running alone: every mode's output is AR's at any concurrency."""
    items = list(items)
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(function, items))


def wait_drafting(address: str, timeout: float = 60.0) -> None:
    """Until the target at `address` has found its drafter SERVING: a session opened for speculation drafts, or
    the target refuses the drafter (built for another target). The target's link probes the drafter's health twice
    a second; a session opened before it found the drafter runs target-only."""
    session = RawSession(address)
    try:
        deadline = time.monotonic() + timeout
        while True:
            opened = session.ok(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(
                mode=common_pb2.DECODE_MODE_SPECULATION)))
            session.ok(release=target_pb2.Release(session_id=opened.session_id))
            drafting = opened.step_mode == common_pb2.DECODE_MODE_SPECULATION
            if drafting or "refused the drafter" in opened.fallback_reason:
                return
            assert time.monotonic() < deadline, f"the target at {address} has no drafter: {opened.fallback_reason}"
            time.sleep(0.2)
    finally:
        session.close()


@pytest.fixture(scope="session")
def spec_target(draft_address: str) -> tuple[str, str]:
    """A second target that drafts with the random drafter (Steps and its Generate RPC) and exports Prometheus
    metrics: (gRPC address, metrics URL)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    with target_with_drafter(draft_address, "--metrics-port", str(metrics_port)) as address:
        yield address, f"http://127.0.0.1:{metrics_port}/metrics"


@pytest.fixture(scope="session")
def spec_target_address(spec_target: tuple[str, str]) -> str:
    return spec_target[0]


@pytest.fixture()
def client(target_address: str):
    with TargetClient(target_address, timeout=300) as c:
        yield c


class RawSession:
    """A TargetSession stream for tests: send ops, get responses (status not checked)."""

    def __init__(self, address: str, own_connection: bool = False) -> None:
        """own_connection: a connection of its own, so another principal (a process's channels of equal options
        share one connection)."""
        options = [("grpc.max_send_message_length", 64 << 20), *([("grpc.use_local_subchannel_pool", 1)]
                                                                  if own_connection else [])]
        self.channel = grpc.insecure_channel(address, options=options)
        self.stream = SessionStream(target_pb2_grpc.TargetServiceStub(self.channel).TargetSession, timeout=300)
        self.next_id = 0

    def call(self, **op) -> target_pb2.TargetSessionResponse:
        self.next_id += 1
        response = self.stream.call(target_pb2.TargetSessionRequest(request_id=self.next_id, **op))
        assert response.request_id == self.next_id
        return response

    def ok(self, **op):
        response = self.call(**op)
        assert response.status.code == 0, response.status.message
        return getattr(response, response.WhichOneof("result"))

    def close(self) -> None:
        self.stream.close()
        self.channel.close()


@pytest.fixture()
def raw(target_address: str):
    session = RawSession(target_address)
    yield session
    session.close()


def health_status(address: str, service: str = SERVICE) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=HANG_S).status


def assert_serving(address: str) -> None:
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING


def wait_live_sessions(address: str, wanted: int, timeout: float = HANG_S) -> None:
    """Until the target at `address` counts `wanted` live sessions (GetModelInfo); fails the test after `timeout`."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        while (live := stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=HANG_S).live_sessions) != wanted:
            assert time.monotonic() < deadline, f"{live} live sessions on {address}, not {wanted}, after {timeout:g} s"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fast_engine(smollm2_path):
    """The embedded SmolLM2 in the fast precision, in this process (no service), for servicer tests without gRPC."""
    from dspark_grpc.target_service.engine import EngineLimits, TargetEngine

    return TargetEngine.load(smollm2_path, limits=EngineLimits(max_length=512), progress=False, precision="fast")
