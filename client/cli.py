"""`dspark`: generate against a running target, or run the whole local demo."""

from __future__ import annotations

import argparse
import json
import sys
import time

from dspark_grpc.client.local_stack import local_target
from dspark_grpc.client.sdk import DEFAULT_TARGET, TargetClient
from google.protobuf.json_format import MessageToDict

DEMO_MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _print_result(client: TargetClient, args: argparse.Namespace, **prompt) -> None:
    t0 = time.perf_counter()
    if args.json:
        r = client.generate(**prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                          "stats": MessageToDict(r.stats, preserving_proto_field_name=True)}, indent=2))
        return
    from dspark_grpc.protos.dspark.v1 import common_pb2

    stats = common_pb2.GenerationStats()
    finish = None
    for text, _, reason in client.stream(**prompt, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                         seed=args.seed, stop=args.stop, stats=stats):
        finish = reason
        sys.stdout.write(text)
        sys.stdout.flush()
    wall = time.perf_counter() - t0
    mode = common_pb2.DecodeMode.Name(stats.mode_run).removeprefix("DECODE_MODE_").lower()
    print(f"\n\n--- {stats.generated_tokens} tokens in {wall:.2f} s ({stats.generated_tokens / wall:.1f} tok/s "
          f"end to end, prefill {stats.prefill_seconds * 1000:.0f} ms for {stats.prompt_tokens} prompt tokens); "
          f"mode {mode}; {stats.steps} target steps; finish: {finish}")


def health_check(address: str, service: str = "", timeout: float = 5.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            print(f"{address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return False
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
    return response.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="dspark", description="dspark-grpc client")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate with a running target service")
    g.add_argument("prompt", nargs="?", help="plain-text prompt (used verbatim)")
    g.add_argument("--messages", help="chat messages as JSON: [{\"role\": \"user\", \"content\": \"...\"}]")
    g.add_argument("--target", default=DEFAULT_TARGET)
    g.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON")
    _generation_args(g)
    d = sub.add_parser("demo", help="start the target service on the embedded default model and chat with it")
    d.add_argument("--message", default=DEMO_MESSAGES[0]["content"])
    d.add_argument("--json", action="store_true")
    _generation_args(d)
    h = sub.add_parser("health", help="exit 0 if the service at ADDRESS reports SERVING (for container health checks)")
    h.add_argument("address", nargs="?", default=DEFAULT_TARGET)
    h.add_argument("--service", default="", help="service name; empty = the whole server")
    args = p.parse_args(argv)

    if args.command == "health":
        sys.exit(0 if health_check(args.address, args.service) else 1)

    if args.command == "generate":
        if (args.prompt is None) == (args.messages is None):
            p.error("give a prompt or --messages")
        prompt = {"prompt": args.prompt} if args.prompt is not None else {"messages": json.loads(args.messages)}
        with TargetClient(args.target) as client:
            _print_result(client, args, **prompt)
        return

    print("Starting the target service (SmolLM2-135M-Instruct, embedded GGUF) on a free loopback port...",
          file=sys.stderr)
    with local_target(["--threads", "0"]) as address, TargetClient(address) as client:
        client.wait_ready(timeout=300)
        info = client.model_info()
        print(f"target {info.model_name} ({info.architecture}, {info.num_layers} layers) SERVING at {address}\n"
              f"user: {args.message}\nassistant: ", file=sys.stderr, flush=True)
        _print_result(client, args, messages=[{"role": "user", "content": args.message}])


if __name__ == "__main__":
    main()
