"""The client SDK: generation over gRPC against a running target service. Needs only grpcio + protobuf."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from dspark_grpc.client.generation import GenerationConfig, RequestError, generate_deltas
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc

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


class TargetStream:
    """A TargetSession stream driven one request/response at a time (closing it frees its sessions)."""

    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, timeout: float | None) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.TargetSession(iter(self._requests.get, None), timeout=timeout)

    def call(self, request: target_pb2.TargetSessionRequest) -> target_pb2.TargetSessionResponse:
        self._requests.put(request)
        try:
            return next(self._responses)
        except grpc.RpcError as e:
            raise RequestError(e.code().value[0], e.details() or str(e.code())) from e

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()


class TargetClient:
    """Generate text with a dspark target service. `timeout` is the deadline of each request, in seconds."""

    def __init__(self, address: str = DEFAULT_TARGET, *, timeout: float | None = 600.0) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        self._info: target_pb2.GetModelInfoResponse | None = None

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the service reports SERVING (its model is loaded)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # optional dependency of the SDK

        stub = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"target at {self.address} not SERVING after {timeout:g} s")
            time.sleep(0.2)

    def model_info(self) -> target_pb2.GetModelInfoResponse:
        if self._info is None:
            self._info = self._stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=self.timeout)
        return self._info

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               tokens: list[int] | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | tuple = (),
               ignore_eos: bool = False, stats: common_pb2.GenerationStats | None = None
               ) -> Iterator[tuple[str, list[int], str | None]]:
        """Yields (text, token_ids, finish_reason or None) as tokens are committed."""
        eos = frozenset(self.model_info().eos_token_ids)
        sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop=list(stop),
                                  ignore_eos=ignore_eos)
        target = TargetStream(self._stub, self.timeout)
        try:
            for d in generate_deltas(target, make_prompt(prompt, messages, tokens), config, eos,
                                     stats if stats is not None else common_pb2.GenerationStats()):
                yield d.text, d.token_ids, _FINISH[d.finish_reason] if d.finish_reason else None
        finally:
            target.close()

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Same arguments as `stream`; returns the whole result with per-request stats."""
        stats = common_pb2.GenerationStats()
        text, ids, finish = [], [], None
        for t, toks, reason in self.stream(prompt, stats=stats, **kwargs):
            finish = reason
            text.append(t)
            ids.extend(toks)
        return GenerationResult("".join(text), ids, finish or "", stats)
