"""What a stalled (SIGSTOP) or killed (SIGKILL) drafter costs the target's Generate RPC, as docs/RELIABILITY.md
reports it: AR request time with the drafter alive vs stopped (alone, and started at the stall while 8 speculative
requests are under way), how long the requests under way take to drop the drafter, and how soon Generate
speculates again after SIGCONT or after a restarted drafter is SERVING. Starts its own services (the default target,
a seeded random drafter, --no-cost-profile) on loopback; prints one JSON object. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/drafter_faults.py [--draft-timeout 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

from dspark_grpc.protos.dspark.v1 import common_pb2

from tests.reliability.conftest import draft_args, free_port, service
from tests.reliability.lifecycle_helpers import PROMPTS, Outcome, generate_rpc, join_all, run_all

AR, SPECULATION = common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION


def ar_seconds(address: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        out = Outcome(t_start=time.monotonic())
        generate_rpc(address, PROMPTS[1], out, max_new_tokens=32, ignore_eos=True, mode=AR)
        assert out.code == 0, out.message
        times.append(time.monotonic() - out.t_start)
    return statistics.median(times)


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
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    port = free_port()
    report: dict[str, object] = dict(load_average=os.getloadavg(), draft_timeout=args.draft_timeout)
    with service("draft", draft_args(), port=port) as drafter, \
            service("target", ["--drafter", drafter.address, "--draft-timeout", str(args.draft_timeout)]) as target:
        report["ar_alone_drafter_alive_s"] = ar_seconds(target.address, args.repeats)
        calls = [(generate_rpc, (target.address, p), dict(max_new_tokens=64, ignore_eos=True, mode=SPECULATION))
                 for p in PROMPTS]
        outcomes, threads = run_all(calls)
        for o in outcomes:
            o.started.wait(120)
        drafter.process.send_signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            ar_during = run_all([(generate_rpc, (target.address, PROMPTS[1]), dict(max_new_tokens=32,
                                                                                   ignore_eos=True, mode=AR))])
            assert not join_all(ar_during[1] + threads, 300)
            report["ar_at_the_stall_with_8_speculative_under_way_s"] = ar_during[0][0].seconds
            report["speculative_under_way_done_after_stop_s"] = max(o.t_end for o in outcomes) - t_stop
            report["speculative_under_way_fallback"] = sorted({o.stats.fallback_reason for o in outcomes})
            report["ar_alone_drafter_stopped_s"] = ar_seconds(target.address, args.repeats)
        finally:
            drafter.process.send_signal(signal.SIGCONT)
        report["speculating_again_after_sigcont_s"] = seconds_until_speculating(target.address)
        drafter.process.kill()
        drafter.process.wait()
        with service("draft", draft_args(), port=port):
            report["speculating_again_after_restart_serving_s"] = seconds_until_speculating(target.address)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
