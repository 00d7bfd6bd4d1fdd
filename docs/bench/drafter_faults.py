"""What a stalled (SIGSTOP) or killed (SIGKILL) drafter costs the target's Generate RPC, as docs/RELIABILITY.md
reports it: AR request time with the drafter alive vs stopped (alone, and while 8 speculative requests are under
way, started at the stall), how long the requests under way take to drop the drafter, and how soon Generate
speculates again after SIGCONT or after a restarted drafter is SERVING. Starts its own services (the default target,
a seeded random drafter, --no-cost-profile) on loopback; prints one JSON object. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/drafter_faults.py [--draft-timeout 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.target_service.drafter_link import PROBE_TIMEOUT_S

from tests.reliability.conftest import draft_args, free_port, service
from tests.reliability.lifecycle_helpers import PROMPTS, Outcome, generate_rpc, join_all, run_all

AR, SPECULATION = common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION


def ar_seconds(address: str, repeats: int) -> float:
    """Median seconds of an AR request of 32 tokens, nothing else running."""
    times = []
    for _ in range(repeats):
        out = Outcome(t_start=time.monotonic())
        generate_rpc(address, PROMPTS[1], out, max_new_tokens=32, ignore_eos=True, mode=AR)
        assert out.code == 0, out.message
        times.append(time.monotonic() - out.t_start)
    return statistics.median(times)


def speculative_load(address: str):
    """8 speculative Generate calls of 64 tokens, returned once each has its first tokens."""
    calls = [(generate_rpc, (address, p), dict(max_new_tokens=64, ignore_eos=True, mode=SPECULATION)) for p in PROMPTS]
    outcomes, threads = run_all(calls)
    for o in outcomes:
        o.started.wait(120)
    return outcomes, threads


def ar_during(address: str, threads) -> float:
    """Seconds of one AR request of 32 tokens started now; waits for `threads` too."""
    ar = run_all([(generate_rpc, (address, PROMPTS[1]), dict(max_new_tokens=32, ignore_eos=True, mode=AR))])
    assert not join_all(ar[1] + threads, 300)
    assert ar[0][0].code == 0, ar[0][0].message
    return ar[0][0].seconds


def seconds_until_speculating(address: str, bound: float = 60.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        out = Outcome()
        generate_rpc(address, PROMPTS[0], out, timeout=60, max_new_tokens=3, ignore_eos=True, mode=SPECULATION)
        if out.code == 0 and out.stats.speculative_steps > 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    return float("inf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft-timeout", type=float, default=10.0, help="the target's --draft-timeout")
    p.add_argument("--rounds", type=int, default=3, help="alive/stopped pairs, interleaved (a machine drifts)")
    args = p.parse_args()
    port = free_port()
    rows: dict[str, list] = {k: [] for k in ("ar_alone_alive_s", "ar_alone_stopped_s", "ar_under_load_alive_s",
                                             "ar_under_load_at_stall_s", "under_way_done_after_stop_s",
                                             "speculating_after_sigcont_s")}
    fallbacks: set[str] = set()
    load = [os.getloadavg()[0]]
    with service("draft", draft_args(), port=port) as drafter, \
            service("target", ["--drafter", drafter.address, "--draft-timeout", str(args.draft_timeout)]) as target:
        address = target.address
        for _ in range(args.rounds):
            rows["ar_alone_alive_s"].append(ar_seconds(address, 1))
            drafter.process.send_signal(signal.SIGSTOP)
            try:
                time.sleep(PROBE_TIMEOUT_S + 1)  # the target's probe has found the drafter stalled
                rows["ar_alone_stopped_s"].append(ar_seconds(address, 1))
            finally:
                drafter.process.send_signal(signal.SIGCONT)
            seconds_until_speculating(address)
            outcomes, threads = speculative_load(address)
            rows["ar_under_load_alive_s"].append(ar_during(address, threads))
            outcomes, threads = speculative_load(address)
            drafter.process.send_signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                rows["ar_under_load_at_stall_s"].append(ar_during(address, threads))
                rows["under_way_done_after_stop_s"].append(max(o.t_end for o in outcomes) - t_stop)
                fallbacks.update(o.stats.fallback_reason for o in outcomes)
            finally:
                drafter.process.send_signal(signal.SIGCONT)
            rows["speculating_after_sigcont_s"].append(seconds_until_speculating(address))
            load.append(os.getloadavg()[0])
        drafter.process.kill()
        drafter.process.wait()
        with service("draft", draft_args(), port=port):
            restart = seconds_until_speculating(address)
    report = {k: dict(median=round(statistics.median(v), 2), each=[round(x, 2) for x in v]) for k, v in rows.items()}
    report.update(speculating_after_restart_serving_s=round(restart, 2), fallback_reasons=sorted(fallbacks),
                  draft_timeout=args.draft_timeout, load_average_1min=[round(x, 1) for x in load])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
