"""The client SDK: generation over gRPC against a running target service. Needs only grpcio + protobuf."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from dspark_grpc.client.generation import GenerationConfig, RequestError, SpeculationConfig, generate_deltas
from dspark_grpc.client.planner import PlannerMemory
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_FINISH = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in common_pb2.FinishReason.items()}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # length | eos | stop_string | context_full
    stats: common_pb2.GenerationStats = field(repr=False)


def make_prompt(prompt: str | None = None, messages: list[dict[str, str]] | None = None,
                tokens: list[int] | None = None) -> common_pb2.Prompt:
    if sum(x is not None for x in (prompt, messages, tokens)) != 1:
        raise ValueError("give exactly one of prompt, messages or tokens")
    if prompt is not None:
        return common_pb2.Prompt(text=prompt)
    if messages is not None:
        chat = [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        return common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=chat))
    return common_pb2.Prompt(tokens=common_pb2.TokenIds(ids=tokens))


class SessionStream:
    """A session stream (TargetSession or DraftSession) driven one request/response at a time.

    Closing it ends the stream, which frees its sessions on the server. A reader thread keeps replies, so a
    call can wait with a timeout (a drafter that stops answering is treated as failed, not waited for). Once the
    stream has ended (an error, the deadline, `close`), every later call fails at once with the same status.
    """

    def __init__(self, open_stream: Callable, timeout: float | None) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._responses = open_stream(iter(self._requests.get, None), timeout=timeout)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self._responses:
                self._replies.put(response)
            self._replies.put(RequestError(14, "the server closed the stream"))
        except grpc.RpcError as e:
            self._replies.put(RequestError(e.code().value[0], e.details() or e.code().name))
        except Exception as e:  # noqa: BLE001 - e.g. a reply grpc could not deserialize: still an end, not a hang
            self._replies.put(RequestError(13, f"the stream failed: {type(e).__name__}: {e}"))

    def call(self, request, timeout: float | None = None):
        self.send(request)
        return self.receive(timeout)

    def send(self, request) -> None:
        """Queue a request without waiting for its reply (replies come back in order: `receive` them)."""
        self._requests.put(request)

    def receive(self, timeout: float | None = None):
        """The reply to the oldest request not yet answered."""
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise RequestError(4, f"no reply within {timeout:g} s") from None
        if isinstance(reply, RequestError):
            self._replies.put(reply)  # the stream is over: later calls (a cleanup's release) must not wait
            raise reply
        return reply

    def close(self, reason: str = "the stream was closed") -> None:
        self._requests.put(None)
        self._responses.cancel()
        self._replies.put(RequestError(1, reason))


MODES = ("ar", "speculation", "adaptive")
PROPOSALS = {"chain": draft_pb2.PROPOSAL_KIND_CHAIN, "tree": draft_pb2.PROPOSAL_KIND_TREE}
KERNELS = {"auto": draft_pb2.KERNEL_CHOICE_UNSPECIFIED, "fused": draft_pb2.KERNEL_CHOICE_FUSED,
           "torch": draft_pb2.KERNEL_CHOICE_TORCH}
PROPOSERS = {"default": draft_pb2.PROPOSER_UNSPECIFIED, "dspark": draft_pb2.PROPOSER_DSPARK,
             "ngram": draft_pb2.PROPOSER_NGRAM, "hybrid": draft_pb2.PROPOSER_HYBRID}


# gRPC's reconnect backoff grows to 2 minutes while a service is down: a restarted service would be found only
# after tens of seconds. Retry at least once a second instead.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass(frozen=True)
class ChannelSecurity:
    """One link's security: TLS when `root_ca` (PEM of the CA that signed the server's certificate) or a client
    certificate is given; mutual TLS with `cert_chain` + `private_key`; a bearer token sent with every call (over TLS
    or, on loopback, plaintext). `server_name` overrides the name the server's certificate must carry."""

    root_ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None
    server_name: str | None = None

    @property
    def tls(self) -> bool:
        return self.root_ca is not None or self.cert_chain is not None

    @classmethod
    def from_files(cls, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                   token_file: str | None = None, server_name: str | None = None) -> ChannelSecurity:
        """Reads the PEM files and the token file (its first token: one per line, '#' comments)."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("give the client certificate and its key together (--tls-cert and --tls-key)")
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        token = None
        if token_file:
            lines = [line.split("#", 1)[0].strip() for line in Path(token_file).read_text().splitlines()]
            token = next((t for t in lines if t), None)
            if token is None:
                raise ValueError(f"{token_file} holds no token")
        return cls(read(tls_ca), read(tls_cert), read(tls_key), token, server_name)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _add(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._add(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._add(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def make_channel(address: str, security: ChannelSecurity | None = None) -> grpc.Channel:
    if security is None or not security.tls:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", security.server_name)]
                                     if security.server_name else [])
        credentials = grpc.ssl_channel_credentials(security.root_ca, security.private_key, security.cert_chain)
        channel = grpc.secure_channel(address, credentials, options=options)
    if security is not None and security.token:
        channel = grpc.intercept_channel(channel, _BearerToken(security.token))
    return channel


class TargetClient:
    """Generate text with a dspark target service, speculating with a dspark draft service when given one.

    mode: "ar" (target only), "speculation" (draft every step), "adaptive" (the default: draft while it pays,
    measured online per request; target-only without a drafter). Any drafter failure finishes the request
    target-only with the same tokens and the reason in `stats.fallback_reason`. `timeout` is the deadline of each
    request, in seconds (None: none); `draft_timeout` bounds each drafter call (0 or None: only the deadline does).
    A request always ends by its deadline (plus a round trip), with the gRPC status as a RequestError's code.
    `security` (TLS, client certificate, bearer token) applies to the target link and, unless `draft_security` is
    given, to the drafter link too.
    """

    def __init__(self, address: str = DEFAULT_TARGET, *, drafter: str | None = None, mode: str = "adaptive",
                 proposal: str = "chain", budget: int = 0, kernel: str = "auto", proposer: str = "default",
                 timeout: float | None = 600.0, draft_timeout: float | None = 10.0,
                 security: ChannelSecurity | None = None, draft_security: ChannelSecurity | None = None) -> None:
        self.address = address
        self.drafter_address = drafter
        self.defaults = dict(mode=mode, proposal=proposal, budget=budget, kernel=kernel, proposer=proposer)
        _check_options(**self.defaults)
        self.timeout = timeout
        self.draft_timeout = draft_timeout or None
        self._channel = make_channel(address, security)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        self._draft_channel = make_channel(drafter, draft_security or security) if drafter else None
        self._draft_stub = draft_pb2_grpc.DraftServiceStub(self._draft_channel) if drafter else None
        self._info: target_pb2.GetModelInfoResponse | None = None
        self.planner_memory = PlannerMemory()  # what the adaptive planner learned, carried across requests

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        if self._draft_channel is not None:
            self._draft_channel.close()

    def wait_ready(self, timeout: float = 120.0, unreachable_after: float | None = None) -> None:
        """Block until the target (and the drafter, if any) report SERVING. A service still loading is waited for up
        to `timeout`; with `unreachable_after`, an address where nothing answers at all for that long raises
        ConnectionError instead."""
        start = time.monotonic()
        for channel, address in ((self._channel, self.address), (self._draft_channel, self.drafter_address)):
            answered = False
            while channel is not None and not (state := _serving(channel)):
                answered = answered or state is not None
                waited = time.monotonic() - start
                if unreachable_after is not None and not answered and waited > unreachable_after:
                    raise ConnectionError(f"nothing answers at {address} after {unreachable_after:g} s: is the "
                                          "service running there?")
                if waited > timeout:
                    raise TimeoutError(f"{address} not SERVING after {timeout:g} s")
                time.sleep(0.2)

    def model_info(self, timeout: float | None = None) -> target_pb2.GetModelInfoResponse:
        """The target's info (asked once, then kept); `timeout` defaults to the client's."""
        if self._info is None:
            self._info = self._stub.GetModelInfo(target_pb2.GetModelInfoRequest(),
                                                 timeout=self.timeout if timeout is None else timeout)
        return self._info

    def drafter_info(self) -> draft_pb2.GetDrafterInfoResponse:
        if self._draft_stub is None:
            raise ValueError("no drafter configured: TargetClient(..., drafter='host:port')")
        return self._draft_stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=self.draft_timeout)

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               tokens: list[int] | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | tuple = (),
               ignore_eos: bool = False, mode: str | None = None, proposal: str | None = None,
               budget: int | None = None, kernel: str | None = None, proposer: str | None = None,
               stats: common_pb2.GenerationStats | None = None, _streams: list[SessionStream] | None = None
               ) -> Iterator[tuple[str, list[int], str | None]]:
        """Yields (text, token_ids, finish_reason or None) as tokens are committed. mode/proposal/budget/kernel/
        proposer override the client's defaults for this request. (`_streams` receives the session streams it
        opens, so that another thread can close them: the asyncio client's cancellation.)"""
        chosen = dict(mode=mode, proposal=proposal, budget=budget, kernel=kernel, proposer=proposer)
        options = {**self.defaults, **{k: v for k, v in chosen.items() if v is not None}}
        _check_options(**options)
        stats = stats if stats is not None else common_pb2.GenerationStats()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout

        def remaining() -> float | None:  # the request's deadline covers every call it makes
            return None if deadline is None else max(deadline - time.monotonic(), 1e-3)

        eos = frozenset(self.model_info(remaining()).eos_token_ids)
        sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop=list(stop),
                                  ignore_eos=ignore_eos)
        if options["mode"] == "speculation" and self._draft_stub is None:
            raise ValueError("mode 'speculation' needs a drafter: TargetClient(..., drafter='host:port')")
        streams = _streams if _streams is not None else []
        streams.append(SessionStream(self._stub.TargetSession, remaining()))
        try:
            speculation = None
            if options["mode"] != "ar":
                if self._draft_stub is None:
                    stats.fallback_reason = "no drafter configured"
                else:
                    draft_timeout = min((t for t in (self.draft_timeout, remaining()) if t), default=None)
                    speculation = open_speculation(self._draft_stub, PROPOSALS[options["proposal"]], options["budget"],
                                                   KERNELS[options["kernel"]], remaining(), draft_timeout, stats,
                                                   PROPOSERS[options["proposer"]],
                                                   adaptive=options["mode"] == "adaptive",
                                                   verify_costs=self.model_info().verify_costs,
                                                   memory=self.planner_memory)
                    if speculation is not None:
                        streams.append(speculation.drafter)
            for d in generate_deltas(streams[0], make_prompt(prompt, messages, tokens), config, eos, stats,
                                     speculation):
                yield d.text, d.token_ids, _FINISH[d.finish_reason] if d.finish_reason else None
        finally:
            for s in streams:
                s.close()

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Same arguments as `stream`; returns the whole result with per-request stats."""
        stats = common_pb2.GenerationStats()
        text, ids, finish = [], [], None
        for t, toks, reason in self.stream(prompt, stats=stats, **kwargs):
            finish = reason
            text.append(t)
            ids.extend(toks)
        return GenerationResult("".join(text), ids, finish or "", stats)


def open_speculation(draft_stub: draft_pb2_grpc.DraftServiceStub, kind: int, budget: int, kernel: int,
                     stream_timeout: float | None, draft_timeout: float | None, stats: common_pb2.GenerationStats,
                     proposer: int = draft_pb2.PROPOSER_UNSPECIFIED, adaptive: bool = False,
                     verify_costs: Sequence[common_pb2.CostTable] = (), memory: PlannerMemory | None = None
                     ) -> SpeculationConfig | None:
    """Ask the drafter who it is and open a draft stream; None (and the reason in stats) if it is unavailable."""
    try:
        info = draft_stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=draft_timeout)
    except grpc.RpcError as e:
        stats.fallback_reason = f"drafter unavailable ({e.code().name}: {e.details()}); target-only"
        return None
    return SpeculationConfig(drafter=SessionStream(draft_stub.DraftSession, stream_timeout), info=info, kind=kind,
                             budget=budget, kernel=kernel, proposer=proposer, adaptive=adaptive,
                             timeout_s=draft_timeout, verify_costs=list(verify_costs), memory=memory)


def _check_options(mode: str, proposal: str, budget: int, kernel: str, proposer: str) -> None:
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {tuple(PROPOSERS)}, got {proposer!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {tuple(PROPOSALS)}, got {proposal!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {kernel!r}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0 (0 = the drafter's default), got {budget}")


def _serving(channel: grpc.Channel) -> bool | None:
    """SERVING: True; answering but not (yet) serving: False; nothing answers: None."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    except grpc.RpcError as e:
        return None if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else False
    return status == health_pb2.HealthCheckResponse.SERVING
