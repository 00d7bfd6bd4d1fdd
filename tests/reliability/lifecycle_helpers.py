"""Calls for the lifecycle tests, each run in its own thread with a bound, recording how it ended and when."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from dspark_grpc.client import TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.speculation.generation import RequestError

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
           "Write a haiku about rain.", "The quick brown fox", "In 1969, astronauts", "import numpy as np\n"]


@dataclass
class Outcome:
    """How one call ended: code 0 = OK (gRPC numbering otherwise), the tokens it streamed, when it ended."""
    code: int | None = None
    message: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: common_pb2.GenerationStats | None = None
    started: threading.Event = field(default_factory=threading.Event)  # the first tokens came back
    t_start: float = 0.0
    t_end: float | None = None

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


def generate_rpc(address: str, prompt: str, out: Outcome, *, timeout: float | None = None, **fields) -> None:
    """The Generate RPC (server-side generation), streamed."""
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=prompt), **fields)
        try:
            for r in stub.Generate(request, timeout=timeout):
                out.token_ids.extend(r.token_ids)
                if r.HasField("stats"):
                    out.stats = r.stats
                out.started.set()
            out.code = 0
        except grpc.RpcError as e:
            out.code, out.message = e.code().value[0], e.details() or ""


def sdk_stream(client: TargetClient, prompt: str, out: Outcome, **kwargs) -> None:
    stats = common_pb2.GenerationStats()
    try:
        for _, ids, _ in client.stream(prompt, stats=stats, **kwargs):
            out.token_ids.extend(ids)
            out.started.set()
        out.code, out.stats = 0, stats
    except RequestError as e:
        out.code, out.message = e.code, e.message
    except grpc.RpcError as e:  # a unary call of the SDK (model info) on a dead server
        out.code, out.message = e.code().value[0], e.details() or ""


def run_all(calls: list[tuple[Callable[..., None], tuple, dict]]) -> tuple[list[Outcome], list[threading.Thread]]:
    """Start each `fn(*args, out, **kwargs)` in a daemon thread; returns their outcomes and threads."""
    outcomes, threads = [], []
    for fn, args, kwargs in calls:
        out = Outcome(t_start=time.monotonic())

        def body(fn=fn, args=args, kwargs=kwargs, out=out) -> None:
            try:
                fn(*args, out, **kwargs)
            finally:
                out.t_end = time.monotonic()
                out.started.set()

        t = threading.Thread(target=body, daemon=True)
        t.start()
        outcomes.append(out)
        threads.append(t)
    return outcomes, threads


def join_all(threads: list[threading.Thread], timeout: float) -> list[int]:
    """Indices of the calls still running `timeout` s from now (hung)."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    return [i for i, t in enumerate(threads) if t.is_alive()]


def start_load(address: str, clients: list[TargetClient], max_new_tokens: int, n_rpc: int = 4, mode: str = "ar"):
    """n_rpc Generate calls and one SDK stream per client (mode "ar" or "speculation": the target drafts with its
    drafter), all started; returns (outcomes, threads) once each has its first tokens."""
    rpc_mode = {"ar": common_pb2.DECODE_MODE_AR, "speculation": common_pb2.DECODE_MODE_SPECULATION}[mode]
    calls = [(generate_rpc, (address, PROMPTS[i]), dict(max_new_tokens=max_new_tokens, ignore_eos=True,
                                                        mode=rpc_mode)) for i in range(n_rpc)]
    calls += [(sdk_stream, (c, PROMPTS[n_rpc + i]), dict(max_new_tokens=max_new_tokens, ignore_eos=True, mode=mode))
              for i, c in enumerate(clients)]
    outcomes, threads = run_all(calls)
    for out in outcomes:
        assert out.started.wait(120), "a call got no first token"
    return outcomes, threads
