"""The reliability suite: the real services as child processes on loopback (`--no-cost-profile`), one pair per
test module; helpers to read their live sessions and memory, and to wait with a bound."""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from dspark_grpc.client.local_stack import local_drafter, local_target
from dspark_grpc.protos.dspark.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_SESSIONS = 16
# Loads GGUF weights for the default target (and the random drafter's embedding): a busy 2-core machine is slow
START_TIMEOUT = 300.0
# The bound of a wait for something the services do at once (a reply, a session freed): only a hang reaches it, on a
# machine ten times slower than a developer's too. Waits poll, so they end as soon as the condition holds.
HANG_S = 120.0


@dataclass
class Service:
    address: str
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.process.pid


@contextlib.contextmanager
def service(kind: str, args: list[str] = (), *, port: int = 0) -> Iterator[Service]:
    """A started `dspark-target serve` ("target") or `dspark-draft serve` ("draft"), SERVING; stopped on exit
    (SIGTERM, then SIGKILL after 30 s), whatever a test did to it."""
    start = local_target if kind == "target" else local_drafter
    procs: list[subprocess.Popen] = []
    argv = [*args, "--no-cost-profile", "--quiet"]
    with start(argv, echo=False, port=port, process=procs, start_timeout=START_TIMEOUT) as address:
        wait_until(lambda: health(address) == health_pb2.HealthCheckResponse.SERVING, START_TIMEOUT,
                   f"{kind} at {address} SERVING")
        yield Service(address, procs[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def draft_args(seed: int = 0) -> list[str]:
    """A seeded random DSpark drafter for the default target: cheap to load, drafts every step."""
    return ["--drafter", "random", "--seed", str(seed), "--max-sessions", str(MAX_SESSIONS)]


@pytest.fixture(scope="module")
def drafter() -> Iterator[Service]:
    with service("draft", draft_args()) as s:
        yield s


@pytest.fixture(scope="module")
def target(drafter: Service) -> Iterator[Service]:
    """The default target, started with `--drafter`: its sessions (Generate's and the SDK's Steps) speculate with the
    module's drafter."""
    with service("target", ["--drafter", drafter.address, "--max-sessions", str(MAX_SESSIONS)]) as s:
        yield s


def wait_until(condition: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> float:
    """Poll `condition` until it holds; fail the test after `timeout` s. Returns the seconds it took."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"not within {timeout:g} s: {what}")
        time.sleep(every)
    return time.monotonic() - t0


def health(address: str, service_name: str = "", timeout: float = HANG_S) -> int | None:
    """The health status, None when the service does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service_name),
                                                             timeout=timeout).status
        except grpc.RpcError:
            return None


def target_info(address: str) -> target_pb2.GetModelInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(target_pb2.GetModelInfoRequest(),
                                                                        timeout=HANG_S)


def drafter_info(address: str) -> draft_pb2.GetDrafterInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return draft_pb2_grpc.DraftServiceStub(channel).GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(),
                                                                         timeout=HANG_S)


def live_sessions(target_address: str, draft_address: str | None = None) -> tuple[int, int]:
    """(live sessions on the target, on the drafter or 0)."""
    draft = drafter_info(draft_address).live_sessions if draft_address else 0
    return target_info(target_address).live_sessions, draft


def rss_mb(pid: int) -> float:
    """Resident memory of a process, MiB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="reliability: the long fuzz run (>= 50,000 messages instead of >= 2,000)")


class Ops:
    """One session stream (TargetSession or DraftSession) for tests: `ops(open=...)` sends one operation and returns
    its response (status unchecked); `ops.ok(...)` returns the result and fails the test on a status."""

    def __init__(self, method, request_type, timeout: float = 60.0, metadata: tuple = ()) -> None:
        from dspark_grpc.speculation.channel import SessionStream

        opener = functools.partial(method, metadata=list(metadata)) if metadata else method
        self.stream = SessionStream(opener, timeout)
        self.request_type, self.timeout, self.next_id = request_type, timeout, 0

    def __call__(self, **op):
        self.next_id += 1
        return self.stream.call(self.request_type(request_id=self.next_id, **op), timeout=self.timeout)

    def ok(self, **op):
        response = self(**op)
        assert response.status.code == 0, response.status.message
        return getattr(response, response.WhichOneof("result"))

    def close(self) -> None:
        self.stream.close()
