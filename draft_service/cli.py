"""`dspark-draft serve`: the DSpark draft service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path

import dspark_grpc.serving.openmp  # noqa: F401  (before torch: libgomp's spin count)
import torch
from dspark_grpc.draft_service.engine import (
    DEFAULT_MAX_PER_PRINCIPAL,
    DEFAULT_MAX_SESSIONS,
    PROPOSERS,
    DraftEngine,
    DraftLimits,
)
from dspark_grpc.draft_service.servicer import DraftServicer
from dspark_grpc.protos.dspark.v1 import draft_pb2, draft_pb2_grpc
from dspark_grpc.runtime.drafting.markov import KERNELS
from dspark_grpc.runtime.formats.checkpoint import PRECISIONS
from dspark_grpc.runtime.kernels.compiled_step import COMPILE_MODES, resolve_compile_mode
from dspark_grpc.runtime.kernels.cpu_kernels import default_compile_cache
from dspark_grpc.serving.security import server_security
from dspark_grpc.serving.server import add_serve_arguments, checked_device, exit_now, in_thread_that_ends, serve
from dspark_grpc.serving.session_socket import SessionSocketServer
from dspark_grpc.speculation.cost_table import default_cache_dir
from dspark_grpc.speculation.wire import AUTO

from dspark_grpc.cli_common import OneLineParser, port_number, positive_int

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dspark-draft", description="DSpark draft service (gRPC)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="load a DSpark drafter and serve dspark.v1.DraftService")
    s.add_argument("--drafter", default=None,
                   help="DSpark drafter checkpoint: an HF directory (z-lab DFlash, DeepSpec DSpark or speculators "
                        "layout) or a GGUF from dspark-convert; 'embedded' = the drafter shipped for the embedded "
                        "SmolLM2-135M-Instruct; 'random' = a seeded random drafter for the target (tests, demos); "
                        "'none' = prompt lookup only. Default: embedded for the embedded target (no "
                        "--target-model), none otherwise")
    s.add_argument("--proposer", choices=PROPOSERS, default=None,
                   help="default proposer: hybrid (n-gram branches merged into the DSpark tree) with a drafter, "
                        "ngram (prompt lookup) without one")
    s.add_argument("--target-model", default=None,
                   help="the target checkpoint the drafter belongs to (its embedding/lm_head and fingerprint); "
                        "default: the embedded SmolLM2-135M-Instruct GGUF")
    s.add_argument("--seed", type=int, default=0, help="seed of --drafter random")
    s.add_argument("--max-tree-budget", type=positive_int, default=64,
                   help="most draft tokens one tree (or prompt lookup) proposal may hold (a larger budget is refused)")
    s.add_argument("--ngram-min", type=positive_int, default=2, help="shortest suffix prompt lookup matches")
    s.add_argument("--ngram-max", type=positive_int, default=4, help="longest suffix prompt lookup matches")
    s.add_argument("--kernel", choices=KERNELS, default=AUTO,
                   help="Markov chain path when a request does not choose: auto = the fused Triton kernel on CUDA, "
                        "the torch path elsewhere")
    s.add_argument("--precision", choices=PRECISIONS, default="fast",
                   help="fast: the drafter's projections and head as Q8_0 blocks on our CPU kernels (where they "
                        "build; int8 weights and activations, as llama.cpp multiplies them); exact: in --dtype. "
                        "The drafter's rounding only changes what it proposes: the target's output is the same")
    s.add_argument("--compile", choices=("auto", *COMPILE_MODES), default="auto",
                   help="fast/max: a lone session's greedy DSpark chain runs as one compiled graph (torch.compile; "
                        "compiled once at start-up, saved in --compile-cache); auto: $DSPARK_COMPILE if set, else max "
                        "with --precision fast on the CPU, else off")
    s.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                   help="where compiled graphs are saved and looked up; default $DSPARK_COMPILE_CACHE, else "
                        "~/.cache/dspark-grpc/compiled")
    s.add_argument("--session-socket", default="auto",
                   help="a Unix socket that serves the DraftSession stream too, for a target on this machine (less "
                        "latency per round than gRPC on loopback; only this user is served): 'auto' (an abstract "
                        "socket, no file; only when the gRPC port has no TLS and no token: the socket asks for "
                        "neither), a PATH (a socket file of mode 0600) or 'none'")
    s.add_argument("--metrics-port", type=port_number, default=None,
                   help="serve Prometheus metrics (proposals, drafter passes) at http://HOST:PORT/metrics; 0 picks "
                        "a free port")
    add_serve_arguments(s, default_port=50052, default_threads=1,
                        threads_help="torch threads; 0 = torch's default. One by default: the drafter is small, and "
                                     "a second OpenMP thread mostly takes a core from a target on the same machine "
                                     "(measured in docs/PERFORMANCE.md)",
                        default_max_sessions=DEFAULT_MAX_SESSIONS, default_per_principal=DEFAULT_MAX_PER_PRINCIPAL,
                        per_principal_note="A target drafts all its sessions as one principal: give at least its "
                                           "--max-sessions (the default holds a target with default flags; "
                                           "--max-sessions holds two and the reserve). ")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    # a path that is not there fails now, not after the target checkpoint has been loaded
    if args.drafter not in (None, "embedded", "random", "none") and not Path(args.drafter).exists():
        p.error(f"--drafter {args.drafter}: no such file or directory (a DSpark/DFlash HF directory or GGUF; or "
                "embedded, random, none)")
    if args.target_model is not None and not Path(args.target_model).exists():
        p.error(f"--target-model {args.target_model}: no such file or directory")
    device = checked_device(p, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    servicer = DraftServicer(max_message_bytes=args.max_message_bytes, max_sessions=args.max_sessions)
    metrics = None
    if args.metrics_port is not None:
        from dspark_grpc.serving.service_metrics import DraftServiceMetrics, forward_threads_gauge, live_sessions_gauge

        metrics = DraftServiceMetrics()
        live_sessions_gauge(metrics.registry, "draft",
                            lambda: len(servicer.engine.sessions) if servicer.engine is not None else 0)
        forward_threads_gauge(metrics.registry, "drafter",
                              lambda: servicer.engine.threads.current if servicer.engine is not None else 0)
        server = metrics.serve(args.metrics_port, addr=args.host)
        print(f"[dspark-draft] metrics at http://{args.host}:{server.server_port}/metrics", flush=True)
    limits = DraftLimits(max_sessions=args.max_sessions, idle_ttl_s=args.session_ttl,
                         max_tree_budget=args.max_tree_budget, default_kernel=args.kernel,
                         default_proposer=args.proposer or "", ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                         max_sessions_per_principal=args.max_sessions_per_principal,
                         reserved_sessions=args.reserved_sessions,
                         adaptive_threads=not args.fixed_threads)
    security = server_security(args)

    def load() -> None:
        drafter = args.drafter or ("embedded" if args.target_model is None else "none")
        compile_cache = args.compile_cache or default_compile_cache()
        os.environ.setdefault("DSPARK_COMPILE_CACHE", str(compile_cache))  # the C++ kernels' build too
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
        compile_mode, why = resolve_compile_mode(args.compile, args.precision, device.type == "cpu")
        if why and not args.quiet:
            print(f"[dspark-draft] compile {compile_mode} ({why})", flush=True)
        engine = in_thread_that_ends(lambda: DraftEngine.load(
            None if drafter == "none" else drafter, args.target_model, dtype=getattr(torch, args.dtype), limits=limits,
            progress=not args.quiet, seed=args.seed, precision=args.precision, device=device, compile=compile_mode,
            compile_cache=compile_cache))
        if engine.drafter is not None and not args.no_cost_profile:
            t0 = time.perf_counter()
            tables = engine.profile_costs(args.cost_cache or default_cache_dir())
            for t in tables:
                print(f"[dspark-draft] propose cost, {t.key.lanes} lane(s): {t.describe()}", flush=True)
            print(f"[dspark-draft] cost tables ready in {time.perf_counter() - t0:.1f} s", flush=True)
        engine.metrics = metrics
        servicer.engine = engine

    companions = []
    if args.session_socket != "none" and not (args.session_socket == "auto" and security.protected):
        servicer.session_socket = SessionSocketServer(
            None if args.session_socket == "auto" else Path(args.session_socket), servicer.handle,
            servicer.release_owner, draft_pb2.DraftSessionRequest, draft_pb2.DraftSessionResponse,
            args.max_message_bytes, prefix="dspark-draft-")
        companions.append(servicer.session_socket)
    asyncio.run(serve(service_name=SERVICE_NAME,
                      register=lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
                      load=load, host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                      grace_s=args.grace, log_prefix="[dspark-draft]", security=security, companions=companions))
    exit_now()


if __name__ == "__main__":
    main()
