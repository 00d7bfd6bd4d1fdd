"""What one client's long prompt costs another client's short request, as docs/RELIABILITY.md reports it: a 32-token
greedy AR request alone vs while a ~4,000-token prompt prefills, and that prompt's prefill (its first token) alone vs
beside the short request. Rounds interleave the three measurements (a machine drifts); ratios are per round. Starts
its own target (the default model and precision, no drafter) on loopback; prints one JSON object (machine, commit,
results) and, with --plot, draws each round's two ratios. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/long_prompt_fairness.py [--prompt-tokens 4000] [--rounds 3] [--plot P]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from dspark_grpc.bench.machine import git_commit, machine_info
from dspark_grpc.protos.dspark.v1 import common_pb2

from tests.reliability.conftest import service
from tests.reliability.lifecycle_helpers import PROMPTS, Outcome, generate_rpc, join_all, run_all

AR = common_pb2.DECODE_MODE_AR
PARAGRAPH = ("The history of computing is a story of layers: each generation of machines hides the one before it "
             "behind a simpler interface, and each interface becomes the foundation of the next. ")


def short(address: str) -> Outcome:
    out = Outcome(t_start=time.monotonic())
    generate_rpc(address, PROMPTS[1], out, max_new_tokens=32, ignore_eos=True, mode=AR)
    out.t_end = time.monotonic()
    assert out.code == 0, out.message
    return out


def long_prefill(address: str, text: str) -> Outcome:
    """The long prompt with one new token: its time is the prefill's (and one step)."""
    out = Outcome(t_start=time.monotonic())
    generate_rpc(address, text, out, max_new_tokens=1, ignore_eos=True, mode=AR)
    out.t_end = time.monotonic()
    assert out.code == 0, out.message
    return out


def together(address: str, text: str, head_start_s: float) -> tuple[float, float]:
    """The long prompt, then the short request `head_start_s` later (the prompt is prefilling): their seconds."""
    calls, threads = run_all([(generate_rpc, (address, text), dict(max_new_tokens=1, ignore_eos=True, mode=AR))])
    time.sleep(head_start_s)
    s = short(address)
    assert not join_all(threads, 600) and calls[0].code == 0, calls[0].message
    return s.seconds, calls[0].seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=4000, help="about how long the long prompt is")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--head-start", type=float, default=0.5, help="seconds the long prompt prefills alone first")
    p.add_argument("--target-arg", action="append", default=[], help="extra argument for dspark-target serve")
    p.add_argument("--plot", help="write a PNG of each round's ratios here")
    args = p.parse_args()
    rows: dict[str, list[float]] = {k: [] for k in ("short_alone_s", "short_beside_prefill_s", "prefill_alone_s",
                                                    "prefill_beside_short_s")}
    load = [os.getloadavg()[0]]
    with service("target", args.target_arg) as target:
        words_per_token = 0.9  # (this paragraph, SmolLM2 tokenizer)
        text = PARAGRAPH * max(1, round(args.prompt_tokens * words_per_token / len(PARAGRAPH.split())))
        prompt_tokens = long_prefill(target.address, text).stats.prompt_tokens  # (also warms the path up)
        short(target.address)
        for _ in range(args.rounds):
            rows["short_alone_s"].append(short(target.address).seconds)
            rows["prefill_alone_s"].append(long_prefill(target.address, text).seconds)
            s, lp = together(target.address, text, args.head_start)
            rows["short_beside_prefill_s"].append(s)
            rows["prefill_beside_short_s"].append(lp)
            load.append(os.getloadavg()[0])
    short_ratio = [b / a for a, b in zip(rows["short_alone_s"], rows["short_beside_prefill_s"], strict=True)]
    prefill_ratio = [b / a for a, b in zip(rows["prefill_alone_s"], rows["prefill_beside_short_s"], strict=True)]
    results = {k: dict(median=round(statistics.median(v), 3), each=[round(x, 3) for x in v]) for k, v in rows.items()}
    results.update(short_ratio=[round(x, 2) for x in short_ratio], prefill_ratio=[round(x, 2) for x in prefill_ratio],
                   load_average_1min=[round(x, 1) for x in load])
    report = {"command": sys.argv, "machine": machine_info(),
              "config": dict(commit=git_commit() or "unknown", prompt_tokens=prompt_tokens, rounds=args.rounds,
                             head_start_s=args.head_start, target_args=args.target_arg),
              "results": results}
    print(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)


def plot(report: dict, path: str) -> None:
    """Each round's two ratios (beside / alone) against the bounds issue 58 set for them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, m, commit = report["results"], report["machine"], report["config"]["commit"]
    rounds = range(1, len(r["short_ratio"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rounds, r["short_ratio"], "o-", label="32-token request beside the prefill / alone (bound 2.0x)")
    ax.plot(rounds, r["prefill_ratio"], "s-", label="the prefill beside the request / alone (bound 1.2x)")
    for bound in (2.0, 1.2):
        ax.axhline(bound, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(rounds))
    ax.set_xlabel("round (interleaved)")
    ax.set_ylabel("time beside / time alone")
    ax.set_ylim(0, 2.4)
    ax.set_title(f"A {report['config']['prompt_tokens']}-token prompt beside a short request\n"
                 f"{m.get('cpu_model', m.get('processor'))}, {m['cpu_count']} CPUs | commit {commit}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

if __name__ == "__main__":
    main()
