"""What speculating neighbours cost an AR request, as docs/RELIABILITY.md reports it (issue 37, point 4): a 64-token
greedy AR request while 12 other requests decode in AR, and while they decode speculatively (mode SPECULATION), on
the default target and drafter with their start-up cost profiles. Rounds interleave the two neighbourhoods (a
machine drifts); the ratio is per round. The neighbours run long and are cancelled once the AR request has finished.
Prints one JSON object. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/ar_beside_speculation.py [--neighbours 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import threading
import time
import urllib.request

import grpc
from dspark_grpc.client.local_stack import local_drafter, local_target
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from grpc_health.v1 import health_pb2

from tests.reliability.conftest import START_TIMEOUT, free_port, health, wait_until
from tests.reliability.lifecycle_helpers import PROMPTS

AR, SPECULATION = common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION


def timed_ar(stub: target_pb2_grpc.TargetServiceStub, tokens: int, forwards: list | None = None) -> float:
    """Seconds of one AR request; appends to `forwards` the mean sessions and rows of the forwards it stepped in
    and the mean seconds of its verify calls."""
    request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=PROMPTS[1]), max_new_tokens=tokens,
                                         ignore_eos=True, mode=AR)
    t0 = time.perf_counter()
    n, stats = 0, None
    for r in stub.Generate(request, timeout=600):
        n += len(r.token_ids)
        stats = r.stats if r.HasField("stats") else stats
    seconds = time.perf_counter() - t0
    assert n == tokens and stats is not None, n
    if forwards is not None:
        forwards.append(dict(sessions=round(stats.forward_sessions, 1), rows=round(stats.forward_rows, 1),
                             verify_ms=round(1000 * stats.verify_seconds / stats.steps, 1)))
    return seconds


def step_counts(metrics_port: int) -> dict[str, float]:
    """The target's per-step counters of drafting sessions: steps by choice, and the verified draft depth's sum."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("dspark:step_choices_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
        elif line.startswith(("dspark:verified_draft_depth_sum", "dspark:verified_draft_depth_count")):
            counts[line.split()[0].split("_")[-1]] = float(line.split()[-1])
    return counts


@contextlib.contextmanager
def neighbours(stub: target_pb2_grpc.TargetServiceStub, count: int, mode: int, warm_s: float):
    """`count` long requests in `mode`, each past its prefill before this yields; cancelled on exit."""
    calls, started = [], []

    def consume(call, ready: threading.Event) -> None:
        with contextlib.suppress(grpc.RpcError):
            for _ in call:
                ready.set()
        ready.set()

    threads = []
    for i in range(count):
        request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=PROMPTS[i % len(PROMPTS)]),
                                             max_new_tokens=4000, ignore_eos=True, mode=mode)
        call, ready = stub.Generate(request, timeout=600), threading.Event()
        calls.append(call)
        started.append(ready)
        threads.append(threading.Thread(target=consume, args=(call, ready), daemon=True))
        threads[-1].start()
    for ready in started:
        ready.wait(120)
    time.sleep(warm_s)
    try:
        yield
    finally:
        for call in calls:
            call.cancel()
        for t in threads:
            t.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--neighbours", type=int, default=12)
    p.add_argument("--tokens", type=int, default=64, help="new tokens of the measured AR request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm", type=float, default=1.0, help="seconds the neighbours decode before the measurement")
    p.add_argument("--target-arg", action="append", default=[], help="extra argument for dspark-target serve")
    p.add_argument("--draft-arg", action="append", default=[], help="extra argument for dspark-draft serve")
    args = p.parse_args()
    sessions = str(max(16, 2 * (args.neighbours + 1)))
    limits = ["--max-sessions", sessions, "--max-sessions-per-principal", sessions, "--reserved-sessions", "0"]
    rows: dict[str, list[float]] = {"alone_s": [], "beside_ar_s": [], "beside_speculation_s": []}
    spec_steps, forwards = [], {"beside_ar": [], "beside_speculation": []}
    metrics_port = free_port()
    load = [os.getloadavg()[0]]
    target_args = [*limits, "--metrics-port", str(metrics_port), "--quiet", *args.target_arg]
    with local_drafter([*limits, "--quiet", *args.draft_arg], echo=False) as draft_address, \
            local_target(["--drafter", draft_address, *target_args], echo=False) as address, \
            grpc.insecure_channel(address) as channel:
        for a in (draft_address, address):
            wait_until(lambda a=a: health(a) == health_pb2.HealthCheckResponse.SERVING, START_TIMEOUT, f"{a} SERVING")
        stub = target_pb2_grpc.TargetServiceStub(channel)
        timed_ar(stub, args.tokens)  # warm-up
        for _ in range(args.rounds):
            rows["alone_s"].append(timed_ar(stub, args.tokens))
            for mode, key in ((AR, "beside_ar_s"), (SPECULATION, "beside_speculation_s")):
                with neighbours(stub, args.neighbours, mode, args.warm):
                    before = step_counts(metrics_port)
                    rows[key].append(timed_ar(stub, args.tokens, forwards[key[:-2]]))
                    after = step_counts(metrics_port)
                if mode == SPECULATION:
                    spec_steps.append({k: after[k] - before.get(k, 0.0) for k in after})
            load.append(os.getloadavg()[0])
    ratio = [s / a for a, s in zip(rows["beside_ar_s"], rows["beside_speculation_s"], strict=True)]
    report = {k: dict(median=round(statistics.median(v), 3), each=[round(x, 3) for x in v]) for k, v in rows.items()}
    report.update(
        speculation_over_ar=[round(x, 2) for x in ratio], neighbours=args.neighbours, tokens=args.tokens,
        neighbour_steps_while_measured=spec_steps,
        forwards_of_the_measured_request=forwards,
        target_args=args.target_arg, draft_args=args.draft_arg, cpu=platform.processor() or platform.machine(),
        load_average_1min=[round(x, 1) for x in load])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
