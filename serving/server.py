"""What both gRPC services share: server options, health, reflection, start-up and graceful shutdown."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import grpc
import torch
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.runtime.kernels.device import DeviceUnavailable, resolve_device
from dspark_grpc.serving.refusal_log import RefusalLog
from dspark_grpc.serving.security import HEALTH_PREFIX, Guard, ServerSecurity, exposure_warning
from dspark_grpc.serving.sessions import Owner, limits_problem
from dspark_grpc.speculation.errors import InvalidArgument, ServiceError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from dspark_grpc.cli_common import device_choice, fail, non_negative_int, port_number, positive_int

log = logging.getLogger("dspark.serving")
T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a prefill capture of a few thousand rows fits
DTYPES = ("float32", "bfloat16")


def checked_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The serve flags' checks both services share: the session limits (a usage error), then the device (one line,
    exit 1); the device to run on."""
    if problem := limits_problem(args.max_sessions, args.max_sessions_per_principal, args.reserved_sessions):
        p.error(problem)
    try:
        return resolve_device(args.device)
    except DeviceUnavailable as e:
        fail(p.prog, str(e))


def add_serve_arguments(p: argparse.ArgumentParser, default_port: int, default_threads: int = 0,
                        threads_help: str = "torch threads; 0 = torch's default", default_max_sessions: int = 16,
                        default_per_principal: int | None = None, per_principal_note: str = "") -> None:
    """The flags both `serve` commands share; `default_per_principal` None = --max-sessions minus
    --reserved-sessions."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on: 127.0.0.1 = this machine only; 0.0.0.0 = every interface (then use "
                        "TLS or a token, see security below)")
    p.add_argument("--port", type=port_number, default=default_port,
                   help="0 picks a free port (printed at start-up)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype")
    p.add_argument("--device", type=device_choice, default="auto",
                   help="auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N; on CUDA the CPU-only "
                        "parts (the fast precision's C++ kernels, the compiled step) fall back to torch, said at "
                        "start-up (the CUDA paths are not yet measured on a GPU: docs/PERFORMANCE.md)")
    p.add_argument("--threads", type=non_negative_int, default=default_threads, help=threads_help)
    p.add_argument("--fixed-threads", action="store_true",
                   help="always run the model on --threads (default: on one thread while that measures faster, as "
                        "when another process takes a core; the target only where its outputs do not depend on "
                        "the thread count)")
    p.add_argument("--max-sessions", type=positive_int, default=default_max_sessions,
                   help="live sessions (requests in flight) the service holds; one more is refused with "
                        "RESOURCE_EXHAUSTED")
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle session is kept")
    p.add_argument("--max-message-bytes", type=positive_int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest gRPC message the service sends or accepts (a prompt, a reply with hidden states)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds running RPCs get at shutdown")
    p.add_argument("--quiet", action="store_true", help="no load progress")
    p.add_argument("--cost-cache", default=None, metavar="DIR",
                   help="where the start-up cost tables are cached (reused while model, dtype, threads and device are "
                        "unchanged); default: $DSPARK_COST_CACHE, else ~/.cache/dspark-grpc/cost-tables")
    p.add_argument("--no-cost-profile", action="store_true",
                   help="skip profiling costs at start-up (no tables published; the adaptive planner then measures "
                        "online)")
    per_principal_default = "--max-sessions minus --reserved-sessions" if default_per_principal is None else \
        str(default_per_principal)
    p.add_argument("--max-sessions-per-principal", type=non_negative_int, default=default_per_principal, metavar="N",
                   help="live sessions one principal (its bearer token, else its client certificate, else its "
                        "connection: address and port) may hold; 0 = no cap of its own (--reserved-sessions still "
                        f"applies). {per_principal_note}Default: {per_principal_default}")
    p.add_argument("--reserved-sessions", type=non_negative_int, default=None, metavar="N",
                   help="the last free sessions, kept for principals that hold none: a new client can open one "
                        "while others hold all they may. Default: an eighth of --max-sessions, rounded down, at least "
                        "1 (with --max-sessions >= 2)")
    sec = p.add_argument_group("security (default: plaintext, no authentication)")
    sec.add_argument("--tls-cert", default=None, metavar="PEM", help="server certificate chain: serve TLS")
    sec.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None, metavar="PEM",
                     help="require client certificates signed by this CA (mutual TLS)")
    sec.add_argument("--auth-token-file", default=None, metavar="FILE",
                     help="bearer tokens, one per line ('#' comments): every RPC except health must send "
                          "'authorization: Bearer TOKEN'")


def status_code(code: int) -> grpc.StatusCode:
    return next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)


def check_enum(enum, value: int, what: str) -> None:
    """`enum` is a protobuf enum type (e.g. common_pb2.DecodeMode): unknown numbers are INVALID_ARGUMENT."""
    if value not in enum.values():
        raise InvalidArgument(f"{what}: unknown value {value}; use one of {', '.join(enum.keys())}")


refusals = RefusalLog(log)


def log_refusal(what: str, e: ServiceError, stream: object = None) -> None:
    """A refused request is one log line (a bad request is the client's problem, not a traceback); repeats of the
    same refusal on the same stream within an interval are counted into the next line, not written each."""
    message = e.message if len(e.message) <= 300 else e.message[:300] + "..."
    refusals.refused((what, e.status.name, id(stream)), f"{what} refused: {e.status.name}: {message}")


def run_session_op(dispatch: Callable[[object, object], dict], request, owner: object, response_type: type):
    """One operation of a session stream. Every failure becomes an in-band status and the stream goes on."""
    try:
        return response_type(request_id=request.request_id, **dispatch(request, owner))
    except ServiceError as e:
        log_refusal(f"session op {request.WhichOneof('op')}", e, stream=owner)
        status = common_pb2.Status(code=e.code, message=e.message)
    except Exception as e:  # a bug must not take the stream or the server down
        log.exception("session operation failed")
        status = common_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0],
                                   message=f"internal error: {type(e).__name__}: {e}")
    return response_type(request_id=request.request_id, status=status)


async def session_stream(request_iterator, handle: Callable, executor, release_owner: Callable[[object], object],
                         principal: str = "", inline: Callable[[object], bool] | None = None):
    """The body of a session stream RPC: each request is handled off the event loop, in order, by
    `handle(request, owner)`; when the stream ends (done, cancelled, deadline) its sessions are released. The
    stream owns the sessions it opens (another stream gets NOT_FOUND); `principal` counts towards its limit.
    A request for which `inline(request)` is True is handled on the event loop itself (a short one: no thread to
    wake and be woken by, see serving/batching.py `inline`)."""
    owner = Owner(principal)
    op = None
    try:
        async for request in request_iterator:
            if inline is not None and inline(request):
                yield handle(request, owner)
                continue
            op = executor.submit(handle, request, owner)
            yield await asyncio.wrap_future(op)
    finally:
        if op is not None and not op.done():  # cancelled mid-operation: release when it ends (an `open` under way
            op.add_done_callback(lambda _: release_owner(owner))  # would otherwise leave its session behind)
        else:
            release_owner(owner)


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # the clients' keepalive pings are welcome
    ]


class RunningTasks:
    """The requests under way, for a graceful shutdown (the gRPC lifecycle's and the HTTP front's): `drain` waits
    for them up to a grace period, then cancels those left, marked in `ending` (cancelled by the shutdown, not by
    their clients)."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task] = set()
        self.ending: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._running)

    def add(self, task: asyncio.Task) -> None:
        self._running.add(task)
        self._idle.clear()

    def discard(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not self._running:
            self._idle.set()

    async def drain(self, grace_s: float) -> int:
        """Returns how many were cancelled."""
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return 0
        except TimeoutError:
            left = list(self._running)
        self.ending.update(left)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=10)
        return len(left)


class Lifecycle(grpc.aio.ServerInterceptor):
    """Tracks the RPCs under way, health aside, for a graceful shutdown (`drain`): new RPCs are refused with
    UNAVAILABLE while health keeps answering (NOT_SERVING), the server stops as soon as the last real RPC has ended
    (an open health Watch does not hold it), and RPCs still running at the grace period's end get UNAVAILABLE."""

    def __init__(self) -> None:
        self.draining = False
        self.tasks = RunningTasks()

    async def drain(self, grace_s: float) -> int:
        """Refuse new RPCs, wait up to `grace_s` for the running ones, end those left. Returns how many were ended."""
        self.draining = True
        return await self.tasks.drain(grace_s)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_" + \
            ("stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)

        async def enter(context) -> asyncio.Task:
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry elsewhere or "
                                    "after it restarts")
            task = asyncio.current_task()
            self.tasks.add(task)
            return task

        def leave(task: asyncio.Task) -> None:  # not current_task(): a dropped generator is closed by another task
            self.tasks.discard(task)

        async def ended(context) -> None:  # cancelled by `drain`: a status for the client, not a traceback
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server shut down: its grace period ended before "
                                "this call did; retry elsewhere or after it restarts")

        if inspect.isasyncgenfunction(behavior):
            async def tracked(request, context):
                task = await enter(context)
                try:
                    async for response in behavior(request, context):
                        yield response
                except asyncio.CancelledError:
                    if task not in self.tasks.ending:
                        raise
                    await ended(context)
                finally:
                    leave(task)
        else:
            async def tracked(request, context):
                task = await enter(context)
                try:
                    return await behavior(request, context)
                except asyncio.CancelledError:
                    if task not in self.tasks.ending:
                        raise
                    await ended(context)
                finally:
                    leave(task)

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(tracked, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class Companion(Protocol):
    """A server that runs beside the gRPC one in its event loop (the target's HTTP front): started once the gRPC
    port listens, drained with it at shutdown."""

    async def start(self) -> None: ...

    async def drain(self, grace_s: float) -> None: ...


async def serve(*, service_name: str, register: Callable[[grpc.aio.Server], None], load: Callable[[], None],
                host: str, port: int, max_message_bytes: int, grace_s: float, log_prefix: str,
                security: ServerSecurity | None = None, companions: Sequence[Companion] = ()) -> None:
    """Start listening at once (health NOT_SERVING), load the model off the event loop, then report SERVING.

    SIGTERM/SIGINT: health goes NOT_SERVING (and keeps answering), new RPCs are refused with UNAVAILABLE, running
    ones get `grace_s` to finish; the server stops when the last one ends, or at the grace period's end.
    """
    security = security or ServerSecurity()
    lifecycle = Lifecycle()
    server = grpc.aio.server(options=server_options(max_message_bytes),
                             interceptors=[Guard(security.tokens), lifecycle])
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    register(server)
    reflection.enable_server_reflection(
        (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    for name in ("", service_name):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if warning := exposure_warning(host, security):
        print(f"{log_prefix} WARNING: {warning}", file=sys.stderr, flush=True)
    credentials = security.credentials()
    address = f"{host}:{port}"
    try:  # checked first so that a busy port is one line of ours, not also a line of gRPC's core logger
        bound = _can_bind(host, port) and (server.add_secure_port(address, credentials) if credentials
                                           else server.add_insecure_port(address))
    except RuntimeError:  # grpc raises when the address cannot be bound
        bound = 0
    if bound == 0:
        raise SystemExit(f"{log_prefix} error: cannot listen on {host}:{port}: the port is in use or the address is "
                         "not this machine's (another service running? choose --port, or --port 0 for a free one)")
    await server.start()
    print(f"{log_prefix} listening on {host}:{bound} (NOT_SERVING until the model is loaded)", flush=True)
    for companion in companions:
        await companion.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loading = _in_own_thread(loop, load)
    done, _ = await asyncio.wait([loading, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if loading in done:
        if loading.exception() is not None:
            print(f"{log_prefix} failed to load: {loading.exception()}", file=sys.stderr, flush=True)
            await server.stop(0)
            exit_now(1)  # a launcher waits for this process to end: no interpreter teardown that could hang
        for name in ("", service_name):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        print(f"{log_prefix} SERVING on {host}:{bound}", flush=True)
        await stop.wait()
    print(f"{log_prefix} shutting down (grace {grace_s:g} s)", flush=True)
    draining = asyncio.ensure_future(lifecycle.drain(grace_s))  # refuses new RPCs from now on
    companions_draining = [asyncio.ensure_future(companion.drain(grace_s)) for companion in companions]
    await health.enter_graceful_shutdown()
    ended = await draining
    await asyncio.gather(*companions_draining)
    if ended:
        print(f"{log_prefix} {ended} RPC(s) still running at the grace period's end: ended (UNAVAILABLE)", flush=True)
    # The statuses of the RPCs just ended may still be on their way out: stop(0) would replace them with gRPC's own
    # "Cancelling all calls". A short grace lets them go (it ends as soon as they are out; an open health Watch holds
    # it no longer than that); on a busy machine half a second was sometimes too short for one of them.
    await server.stop(2.0 if ended else 0)


def exit_now(code: int = 0) -> None:
    """End the process after a clean shutdown without the interpreter's teardown (freeing the model, gRPC's core):
    it took 1-2 s on a busy 2-core machine, past what a grace period promises, with nothing left to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _in_own_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> asyncio.Future:
    """Run `fn` in a thread that ends with it: torch gives each thread that runs parallel ops an OpenMP team,
    and a team left behind (e.g. in an idle executor thread) slows every later forward (serving/batching.py)."""
    future = loop.create_future()

    def body() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            loop.call_soon_threadsafe(future.set_exception, e)
        else:
            loop.call_soon_threadsafe(future.set_result, None)

    threading.Thread(target=body, name="load", daemon=True).start()
    return future


def in_thread_that_ends(fn: Callable[[], T]) -> T:
    """`fn()` in a thread of its own that ends with it (re-raising its error): the OpenMP team torch gives that thread
    ends with it. A load thread that loaded a model keeps its team, and with it and the batcher worker's team alive
    (more OpenMP threads than cores) every barrier of the worker's forwards sleeps until the load thread ends, the
    start-up profile's included (docs/PERFORMANCE.md). `_in_own_thread` is the same for a function the event loop
    awaits."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            error.append(e)

    thread = threading.Thread(target=body, name="load-model", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _can_bind(host: str, port: int) -> bool:
    """Whether a listener could bind host:port now (port 0 always can)."""
    if port == 0:
        return True
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT does not block
            try:
                s.bind(sockaddr)
            except OSError:
                return False
    return True
