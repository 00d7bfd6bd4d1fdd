"""The client SDK: generation over gRPC against a running target service. Needs only grpcio + protobuf."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from dspark_grpc.speculation import wire
from dspark_grpc.speculation.channel import ChannelSecurity, make_channel, tls_mismatch
from dspark_grpc.speculation.generation import RequestError

DEFAULT_TARGET = "127.0.0.1:50051"
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


MODES = {name: value for name, value in wire.MODES.items() if name}
PROPOSALS = {name: value for name, value in wire.PROPOSALS.items() if name}
KERNELS = {name or wire.AUTO: value for name, value in wire.KERNELS.items()}
PROPOSERS = {name or wire.DEFAULT_PROPOSER: value for name, value in wire.PROPOSERS.items()}
# gRPC name resolvers whose one target can stand for several servers (`dns:///name:port` of a headless Service,
# `ipv4:a:p,b:q`): the channel balances its calls over them round-robin (grpc's default, pick_first, would send
# every call to one)
BALANCED_SCHEMES = ("dns:", "ipv4:", "ipv6:")
ROUND_ROBIN = [("grpc.lb_policy_name", "round_robin")]


def balanced(address: str) -> bool:
    return address.startswith(BALANCED_SCHEMES)


class TargetClient:
    """Generate text with a dspark target service; it speculates with its own drafter (started with --drafter).

    mode: "ar" (target only), "speculation" (draft every step; the target must have a drafter), "adaptive" (the
    default: draft while it pays, decided by the target per step; AR where the target has no drafter). Any drafter
    failure finishes the request target-only with the same tokens and the reason in `stats.fallback_reason`. A
    request is one Generate call: the target runs its steps and streams the tokens (no round trip to the client per
    step); hidden states never reach the client. `timeout` is the deadline of each
    request, in seconds (None: none). A request always ends by its deadline (plus a round trip), with the gRPC
    status as a RequestError's code. `security`: TLS, client certificate, bearer token.

    Several targets (one model): a list of addresses (a channel each), or one `dns:///NAME:PORT` whose name
    resolves to several (a headless Kubernetes Service; one channel balancing round-robin). New requests go to
    them in turn; a request stays on its target. One that fails with UNAVAILABLE before its first reply (the target
    is gone, draining or loading) is sent once more, to the next target; one already streaming from a target that
    goes away fails with UNAVAILABLE. `requests_by_target` counts the requests each address answered.
    """

    def __init__(self, address: str | Sequence[str] = DEFAULT_TARGET, *, mode: str = wire.ADAPTIVE,
                 proposal: str = wire.CHAIN, budget: int = 0, kernel: str = wire.AUTO,
                 proposer: str = wire.DEFAULT_PROPOSER, timeout: float | None = 600.0,
                 security: ChannelSecurity | None = None) -> None:
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses or not all(isinstance(a, str) and a for a in addresses):
            raise ValueError(f"give one target address or a list of them, got {address!r}")
        self.address = address if isinstance(address, str) else ",".join(addresses)
        self.addresses = addresses
        self.defaults = dict(mode=mode, proposal=proposal, budget=budget, kernel=kernel, proposer=proposer)
        _check_options(**self.defaults)
        self.timeout = timeout
        self._channels = [make_channel(a, security, ROUND_ROBIN if balanced(a) else ()) for a in addresses]
        self._stubs = [target_pb2_grpc.TargetServiceStub(channel) for channel in self._channels]
        self._turn = itertools.count()
        self._lock = threading.Lock()
        # requests each address answered (their first reply came from it), and retries: the SDK's own counts
        self.requests_by_target: Counter[str] = Counter()
        self.retries = 0
        self._info: target_pb2.GetModelInfoResponse | None = None

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def _attempts(self) -> list[int]:
        """The targets a new request tries, in order: the next one in turn, then (after UNAVAILABLE before any
        reply) the one after it. One plain address: no retry (its only server is not there); one balanced address
        (`dns:///`, `ipv4:`): once more on the same channel, whose round-robin picks another server."""
        with self._lock:
            first = next(self._turn) % len(self._stubs)
        if len(self._stubs) > 1:
            return [first, (first + 1) % len(self._stubs)]
        return [0, 0] if balanced(self.addresses[0]) else [0]

    def wait_ready(self, timeout: float = 120.0, unreachable_after: float | None = None) -> None:
        """Block until the target reports SERVING (with several targets: until one does, since requests that find
        another one not there go on to the next). A service still loading is waited for up to `timeout`; with
        `unreachable_after`, an address where nothing answers at all for that long raises ConnectionError instead."""
        start = time.monotonic()
        answered = False
        last_error = [""]  # what the last unanswered health check said
        while not any(state := [_serving(channel, last_error) for channel in self._channels]):
            answered = answered or any(s is not None for s in state)
            waited = time.monotonic() - start
            if unreachable_after is not None and not answered and waited > unreachable_after:
                why = tls_mismatch(last_error[0], "TargetClient's security=") or "is the service running there?"
                raise ConnectionError(f"nothing answers at {self.address} after {unreachable_after:g} s: {why}")
            if waited > timeout:
                raise TimeoutError(f"{self.address} not SERVING after {timeout:g} s")
            time.sleep(0.2)

    def model_info(self, timeout: float | None = None) -> target_pb2.GetModelInfoResponse:
        """The target's info (asked once, then kept; with several targets, of the first that answers: they serve
        one model); `timeout` defaults to the client's."""
        for i, stub in enumerate(self._stubs):
            if self._info is not None:
                break
            try:
                self._info = stub.GetModelInfo(target_pb2.GetModelInfoRequest(),
                                               timeout=self.timeout if timeout is None else timeout)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or i + 1 == len(self._stubs):
                    raise
        return self._info

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               tokens: list[int] | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | tuple = (),
               ignore_eos: bool = False, mode: str | None = None, proposal: str | None = None,
               budget: int | None = None, kernel: str | None = None, proposer: str | None = None,
               stats: common_pb2.GenerationStats | None = None, _calls: list | None = None
               ) -> Iterator[tuple[str, list[int], str | None]]:
        """Yields (text, token_ids, finish_reason or None) as tokens are committed. mode/proposal/budget/kernel/
        proposer override the client's defaults for this request. One Generate call: the target runs the steps
        (speculation/generation.py, the loop a TargetSession client would drive) and streams what each commits, so
        no step waits for a round trip to this client. (`_calls` receives the call, so that another thread can
        cancel it: the asyncio client's cancellation.)"""
        chosen = dict(mode=mode, proposal=proposal, budget=budget, kernel=kernel, proposer=proposer)
        options = {**self.defaults, **{k: v for k, v in chosen.items() if v is not None}}
        _check_options(**options)
        if max_new_tokens < 1:
            raise RequestError(3, f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stats = stats if stats is not None else common_pb2.GenerationStats()
        request = target_pb2.GenerateRequest(
            prompt=make_prompt(prompt, messages, tokens), max_new_tokens=max_new_tokens,
            sampling=common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
            stop=list(stop), ignore_eos=ignore_eos, mode=MODES[options["mode"]],
            proposal=PROPOSALS[options["proposal"]], budget=options["budget"], kernel=KERNELS[options["kernel"]],
            proposer=PROPOSERS[options["proposer"]])
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        attempts = self._attempts()
        through_client = request.ByteSize()
        for n, target in enumerate(attempts):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = self._stubs[target].Generate(request, timeout=timeout)
            if _calls is not None:
                _calls.append(call)
            try:
                first = next(call, None)  # an UNAVAILABLE before it: nothing reached the caller, so retry
            except grpc.RpcError as e:
                call.cancel()
                if e.code() == grpc.StatusCode.UNAVAILABLE and n + 1 < len(attempts):
                    with self._lock:  # not there (gone, draining, loading): the next target in turn
                        self.retries += 1
                    continue
                raise RequestError(e.code().value[0], e.details() or e.code().name) from None
            with self._lock:
                self.requests_by_target[self.addresses[target]] += 1
            break
        try:
            # once a reply came, the request stays on its target: a target that goes away fails it (UNAVAILABLE)
            for reply in itertools.chain([first] if first is not None else [], call):
                through_client += reply.ByteSize()
                finish = _FINISH[reply.finish_reason] if reply.finish_reason else None
                if finish is not None:
                    stats.CopyFrom(reply.stats)
                    # what crossed this client (the target's loop counted its in-process session ops)
                    stats.session_bytes, stats.capture_bytes = through_client, 0
                yield reply.text, list(reply.token_ids), finish
        except grpc.RpcError as e:
            raise RequestError(e.code().value[0], e.details() or e.code().name) from None
        finally:
            call.cancel()  # a consumer that stops early ends the request (the target frees its session)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Same arguments as `stream`; returns the whole result with per-request stats."""
        stats = common_pb2.GenerationStats()
        text, ids, finish = [], [], None
        for t, toks, reason in self.stream(prompt, stats=stats, **kwargs):
            finish = reason
            text.append(t)
            ids.extend(toks)
        return GenerationResult("".join(text), ids, finish or "", stats)


def _check_options(mode: str, proposal: str, budget: int, kernel: str, proposer: str) -> None:
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {tuple(PROPOSERS)}, got {proposer!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {tuple(PROPOSALS)}, got {proposal!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {kernel!r}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0 (0 = the drafter's default), got {budget}")


def _serving(channel: grpc.Channel, last_error: list[str] | None = None) -> bool | None:
    """SERVING: True; answering but not (yet) serving: False; nothing answers: None (the error's details then in
    `last_error[0]`)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    except grpc.RpcError as e:
        if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return False
        if last_error is not None:
            last_error[0] = e.details() or ""
        return None
    return status == health_pb2.HealthCheckResponse.SERVING


def drafter_info(address: str, timeout: float = 30.0,
                 security: ChannelSecurity | None = None) -> draft_pb2.GetDrafterInfoResponse:
    """Who the draft service at `address` is (the demo's banner, the bench's record)."""
    with make_channel(address, security) as channel:
        return draft_pb2_grpc.DraftServiceStub(channel).GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(),
                                                                       timeout=timeout)
