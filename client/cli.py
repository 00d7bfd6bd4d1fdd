"""`dspark`: generate against a running target, benchmark AR vs speculation, or run the whole local demo."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable

from dspark_grpc.client.local_stack import ServiceExited, local_target, stop_on_signals
from dspark_grpc.client.sdk import (
    DEFAULT_TARGET,
    KERNELS,
    MODES,
    PROPOSALS,
    PROPOSERS,
    ChannelSecurity,
    TargetClient,
    balanced,
    drafter_info,
    make_channel,
)
from dspark_grpc.speculation.channel import tls_mismatch
from dspark_grpc.speculation.generation import RequestError
from dspark_grpc.speculation.metrics import stats_dict
from dspark_grpc.speculation.wire import ADAPTIVE, AR, AUTO, CHAIN, DEFAULT_PROPOSER, SPECULATION

from dspark_grpc.cli_common import (
    OneLineParser,
    chat_messages,
    fail,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)

DEMO_MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling; 1 = no top-p cut")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="0 = no top-k cut")
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help="sampling seed (the same seed, the same tokens); default: a fresh one per request")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def speculation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proposal", choices=tuple(PROPOSALS), default=CHAIN, help="the drafter's proposal shape")
    p.add_argument("--budget", type=non_negative_int, default=0,
                   help="draft nodes per step; 0 = the drafter's default")
    p.add_argument("--kernel", choices=tuple(KERNELS), default=AUTO, help="the drafter's Markov chain path")
    p.add_argument("--proposer", choices=tuple(PROPOSERS), default=DEFAULT_PROPOSER,
                   help="dspark, ngram (prompt lookup) or hybrid; default = the draft service's default")


def mode_run_words(requested: str, stats) -> str:
    """The mode asked for and what ran: "ar", "adaptive (ran AR)", "speculation (12 speculative + 3 AR steps)"
    (stats.mode_run says speculation as soon as one step speculated)."""
    if not stats.speculative_steps:
        return requested if requested == AR else f"{requested} (ran AR)"
    return f"{requested} ({stats.speculative_steps} speculative + {stats.ar_steps} AR steps)"


def _print_result(client: TargetClient, args: argparse.Namespace, mode: str | None = None, **prompt) -> None:
    """Generate, streaming the text (or printing it as JSON)."""
    t0 = time.perf_counter()
    if args.json:
        r = client.generate(**prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, mode=mode)
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                          "stats": stats_dict(r.stats)}, indent=2))
        return
    from dspark_grpc.protos.dspark.v1 import common_pb2

    stats = common_pb2.GenerationStats()
    finish = None
    for text, _, reason in client.stream(**prompt, max_new_tokens=args.max_new_tokens,
                                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                            seed=args.seed, stop=args.stop, stats=stats, mode=mode):
        finish = reason
        sys.stdout.write(text)
        sys.stdout.flush()
    wall = time.perf_counter() - t0
    print(f"\n\n--- {stats.generated_tokens} tokens in {wall:.2f} s ({stats.generated_tokens / wall:.1f} tok/s "
          f"end to end, prefill {stats.prefill_seconds * 1000:.0f} ms for {stats.prompt_tokens} prompt tokens); "
          f"mode {mode_run_words(mode or args.mode, stats)}; {stats.steps} target steps; finish: {finish}")
    if stats.speculative_steps:
        print(f"--- acceptance length {stats.acceptance_length:.2f} tokens per speculative step, draft "
              f"{stats.draft_seconds:.2f} s, verify {stats.verify_seconds:.2f} s")
    if stats.fallback_reason:
        print(f"--- fallback: {stats.fallback_reason}")


def _security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="talk TLS, trusting this CA (the services' --tls-cert was signed by it)")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate (services with --tls-client-ca)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help="bearer token for services started with --auth-token-file (the file's first token)")


def _security(p: argparse.ArgumentParser, args: argparse.Namespace) -> ChannelSecurity | None:
    if not any((args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file)):
        return None
    try:
        return ChannelSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file)
    except (OSError, ValueError) as e:
        p.error(str(e))


def health_check(address: str, service: str = "", timeout: float = 5.0,
                 security: ChannelSecurity | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with make_channel(address, security) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            hint = tls_mismatch(e.details() or "") if e.code() == grpc.StatusCode.UNAVAILABLE else None
            print(f"{address}: {e.code().name}: {e.details()}" + (f" -- {hint}" if hint else ""), file=sys.stderr)
            return False
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
    return response.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> None:
    report_failures("dspark", lambda: _main(argv))


def report_failures(prog: str, body: Callable[[], None]) -> None:
    """Runs `body`: an ordinary failure (a service that is not running, a refused request, Ctrl-C) is one line on
    stderr and a non-zero exit, never a traceback."""
    try:
        with stop_on_signals():
            body()
    except KeyboardInterrupt:
        fail(prog, "interrupted", code=130)
    except ServiceExited as e:
        fail(prog, str(e))
    except RequestError as e:
        fail(prog, _request_failure(e.code, e.message))
    except (TimeoutError, ConnectionError) as e:
        fail(prog, str(e))
    except ValueError as e:  # an SDK option the server or the SDK refused
        fail(prog, str(e))
    except Exception as e:  # noqa: BLE001 - grpc.RpcError is raised by unary calls
        import grpc

        if isinstance(e, grpc.RpcError):
            fail(prog, _request_failure(e.code().value[0], e.details() or e.code().name))
        raise


def _request_failure(code: int, message: str) -> str:
    import grpc

    name = next((s.name for s in grpc.StatusCode if s.value[0] == code), str(code))
    if name == "UNAVAILABLE" and (hint := tls_mismatch(message)):
        return f"UNAVAILABLE: {message} -- {hint}"
    if name == "UNAVAILABLE":
        return (f"UNAVAILABLE: {message} -- is the service running at that address? Start it with "
                "`dspark-target serve` (`dspark-target serve --drafter ADDRESS` speculates with a running "
                "`dspark-draft serve`), or pass --target HOST:PORT")
    return f"{name}: {message}"


def parser() -> OneLineParser:
    """The `dspark` parser; `.commands` maps each sub-command to its parser."""
    p = OneLineParser(prog="dspark", description="dspark-grpc client")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate with a running target service")
    g.add_argument("prompt", nargs="?", help="plain-text prompt (used verbatim)")
    g.add_argument("--messages", type=chat_messages,
                   help="chat messages as JSON: [{\"role\": \"user\", \"content\": \"...\"}]; roles: system, "
                        "user, assistant, tool")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help="the target service's address (host:port; dns:///NAME:PORT balances over what NAME "
                        "resolves to); several, comma-separated: requests go round-robin")
    g.add_argument("--mode", choices=tuple(MODES), default=ADAPTIVE,
                   help="ar = target only; speculation = draft every step (the target must have been started with "
                        "--drafter); adaptive = speculate while it pays (AR where the target has no drafter)")
    g.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON")
    _security_args(g)
    _generation_args(g)
    speculation_args(g)
    # `dspark bench` is the bench package's program (dspark_grpc.bench.cli, a tool above the SDK; the `dspark` entry
    # point runs it): listed here so that `dspark --help` names it
    sub.add_parser("bench", help="AR vs speculative decoding side by side on a prompt file; JSON + table "
                                 "(`dspark bench --help`)", add_help=False)
    d = sub.add_parser("demo", help="start both services on the embedded default model and generate with AR and "
                                     "with speculation, side by side")
    d.add_argument("--message", default=DEMO_MESSAGES[0]["content"], help="the user message both modes answer")
    d.add_argument("--drafter-checkpoint", default="embedded",
                   help="what the started draft service drafts with: embedded = the DSpark drafter shipped for the "
                        "embedded SmolLM2 (hybrid with prompt lookup), none = prompt lookup only, random = a random "
                        "DSpark drafter, or a DSpark/DFlash checkpoint (HF directory or GGUF)")
    d.add_argument("--rounds", type=positive_int, default=3,
                   help="timed rounds of the three modes in turn after the shown warm-up round: each mode's tok/s is "
                        "reported with its spread over them, a mode compared with AR only where every round agrees")
    d.add_argument("--json", action="store_true", help="print each mode's text, token ids and stats as JSON")
    d.add_argument("--quick", action="store_true",
                   help="a smoke run of the same path: one timed round of 16 new tokens (whatever --rounds and "
                        "--max-new-tokens say), the services without their start-up cost profile")
    _generation_args(d)
    speculation_args(d)
    h = sub.add_parser("health", help="exit 0 if the service at ADDRESS reports SERVING (for container health checks)")
    h.add_argument("address", nargs="?", default=DEFAULT_TARGET, help="the service's address (host:port)")
    h.add_argument("--service", default="", help="service name; empty = the whole server")
    _security_args(h)
    p.commands = {"generate": g, "demo": d, "health": h}
    return p


def _main(argv: list[str] | None) -> None:
    p = parser()
    args = p.parse_args(argv)
    g = p.commands["generate"]

    if args.command == "health":
        sys.exit(0 if health_check(args.address, args.service, security=_security(p.commands["health"], args))
                 else 1)

    if args.command == "generate":
        if args.prompt is not None and args.messages is not None:
            g.error("give either a prompt or --messages, not both")
        if args.prompt is None and args.messages is None:
            g.error("give a prompt (plain text) or --messages (chat JSON)")
        prompt = {"prompt": args.prompt} if args.prompt is not None else {"messages": args.messages}
        try:
            client = TargetClient(_targets(args.target), mode=args.mode, proposal=args.proposal,
                                  budget=args.budget, kernel=args.kernel, proposer=args.proposer,
                                  security=_security(g, args))
        except ValueError as e:
            g.error(str(e))
        with client:
            _print_result(client, args, **prompt)
        return

    if args.command == "bench":
        fail("dspark", "bench is the bench package's program: run the `dspark` command (`dspark bench ...`) or "
                       "`python -m dspark_grpc.bench ...`")

    _demo(args)


def _targets(value: str) -> str | list[str]:
    """--target: one address, or a comma-separated list of them (an `ipv4:a,b` target keeps its commas)."""
    if "," not in value or balanced(value):
        return value
    return [a.strip() for a in value.split(",") if a.strip()]


def _demo(args: argparse.Namespace) -> None:
    """The main job: both services on loopback, the same request with AR and with speculation."""
    from dspark_grpc.client.demo import Run, run_rounds, summary
    from dspark_grpc.client.local_stack import local_drafter

    print("Starting the target service (SmolLM2-135M-Instruct, embedded GGUF) and the draft service "
          f"({args.drafter_checkpoint}) on free loopback ports...", file=sys.stderr, flush=True)
    profile = ["--no-cost-profile"] if args.quick else []
    if args.quick:
        args.rounds, args.max_new_tokens = 1, 16
    with contextlib.ExitStack() as stack:
        # SERVING before the target starts: the two start-up cost profiles must not share the CPU
        drafter = stack.enter_context(local_drafter(["--drafter", args.drafter_checkpoint, *profile],
                                                    wait_serving=True))
        target = stack.enter_context(local_target(["--drafter", drafter, *profile], wait_serving=True))
        client = stack.enter_context(TargetClient(target, proposal=args.proposal, budget=args.budget,
                                                  kernel=args.kernel, proposer=args.proposer))
        client.wait_ready(timeout=300)
        info, dinfo = client.model_info(), drafter_info(drafter)
        print(f"target {info.model_name} ({info.architecture}, {info.num_layers} layers) at {target}; "
              f"drafter {dinfo.name} at {drafter}", file=sys.stderr)
        messages = [{"role": "user", "content": args.message}]
        modes = (AR, SPECULATION, ADAPTIVE)
        compare = args.temperature == 0 or args.seed is not None
        for mode in modes:  # a warm-up round, shown: not counted
            print(f"\n=== {mode} ===\nuser: {args.message}\nassistant: ", flush=True)
            _print_result(client, args, mode=mode, messages=messages)
        print(f"\n=== timing: {args.rounds} rounds of the three modes in turn ({args.max_new_tokens} new tokens each; "
              "the round above warmed up and is not counted)", flush=True)

        def generate(mode: str) -> Run:
            t0 = time.perf_counter()
            r = client.generate(messages=messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, mode=mode)
            return Run(tuple(r.token_ids), time.perf_counter() - t0, r.stats)

        runs = run_rounds(generate, modes, args.rounds, progress=lambda line: print(f"    {line}", flush=True))
        lines = summary(runs, compare)
        print("=== " + "\n=== ".join(lines))
        if compare and not lines[-1].endswith("yes"):
            sys.exit(1)


if __name__ == "__main__":
    from dspark_grpc.cli_common import dspark_main

    dspark_main()
