"""The target's OpenAI-compatible HTTP API (`dspark-target serve --http-port`): POST /v1/chat/completions and
/v1/completions (JSON, or server-sent events with `stream: true`), GET /v1/models and /health, on aiohttp in the
gRPC server's event loop. A request becomes a GenerateRequest and runs through TargetServicer.generation_stream, the
Generate RPC's own path (the same steps, the same tokens); this module translates and validates only.

Extensions: the request's `"dspark": {"mode": "ar" | "speculation" | "adaptive", ...}` (default: the target's
--default-mode) and the response's `"dspark"` object (the request's GenerationStats: mode_run, acceptance_length,
...; and the token ids). Errors are OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from aiohttp import web
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2
from dspark_grpc.serving.security import Guard, principal_of
from dspark_grpc.serving.server import RunningTasks, log_refusal
from dspark_grpc.speculation.errors import InvalidArgument, ServiceError, Unauthenticated, Unavailable
from dspark_grpc.speculation.metrics import stats_dict
from dspark_grpc.speculation.wire import KERNELS, MODES, PROPOSALS, PROPOSERS
from dspark_grpc.target_service.servicer import TargetServicer

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
FINISH = {common_pb2.FINISH_REASON_EOS: "stop", common_pb2.FINISH_REASON_STOP_STRING: "stop",
          common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_CONTEXT_FULL: "length"}
INT32_MAX = (1 << 31) - 1
DSPARK_CHOICES = {"mode": MODES, "proposal": PROPOSALS, "proposer": PROPOSERS, "kernel": KERNELS}
# OpenAI fields this server does not implement: refused when set to anything but their no-op value
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "logit_bias": (None, {}),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0)}


class BadField(InvalidArgument):
    """A bad request field (`param`, as OpenAI's error names it)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class Draining(Unavailable):
    pass


# -- request JSON -> GenerateRequest -----------------------------------------------------------------


def generate_request(body: object, chat: bool) -> tuple[target_pb2.GenerateRequest, bool, bool]:
    """The GenerateRequest of a /v1/chat/completions (`chat`) or /v1/completions body, with whether it streams and
    whether the stream ends with a usage chunk. Every check of a request's fields is here (BadField)."""
    if not isinstance(body, dict):
        raise BadField(None, "the request body must be a JSON object")
    request = target_pb2.GenerateRequest(prompt=_chat_prompt(body.get("messages")) if chat
                                         else _text_prompt(body.get("prompt")))
    for name, allowed in UNSUPPORTED.items():
        if body.get(name, None) not in allowed:
            raise BadField(name, f"{name} is not supported by this server; leave it unset")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadField("response_format", "only response_format {\"type\": \"text\"} is supported")
    if _number(body, "n", int, 1, 1, INT32_MAX) != 1:
        raise BadField("n", "n must be 1 (one completion per request)")
    limits = [name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
    if limits:  # max_completion_tokens (the newer name) wins; unset: the Generate RPC's default
        request.max_new_tokens = _number(body, limits[0], int, None, 1, INT32_MAX)
    request.sampling.temperature = _number(body, "temperature", float, 1.0, 0.0, 2.0)
    request.sampling.top_p = _number(body, "top_p", float, 1.0, 0.0, 1.0)
    request.sampling.top_k = _number(body, "top_k", int, 0, 0, INT32_MAX)  # (vLLM's and SGLang's extension)
    if request.sampling.top_p == 0.0:
        raise BadField("top_p", "top_p must be > 0")
    if body.get("seed") is not None:
        request.sampling.seed = _number(body, "seed", int, None, 0, (1 << 64) - 1)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadField("stop", "stop must be a string or a list of strings")
    request.stop.extend(stop)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadField("stream", "stream must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadField("stream_options", "stream_options must be an object like {\"include_usage\": true}")
    _dspark_options(body.get("dspark"), request)
    return request, stream, bool(options.get("include_usage"))


def _chat_prompt(messages: object) -> common_pb2.Prompt:
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    chat = common_pb2.ChatMessages()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadField(f"messages[{i}]", f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadField(f"messages[{i}].content", "only text content parts ({\"type\": \"text\", \"text\": "
                               "...}) are supported")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise BadField(f"messages[{i}].content", f"messages[{i}].content must be a string or text parts")
        chat.messages.add(role=m["role"], content=content or "")
    return common_pb2.Prompt(chat=chat)


def _text_prompt(prompt: object) -> common_pb2.Prompt:
    """A string, a list of token ids, or a list holding one of those (one prompt per request: n = 1)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return common_pb2.Prompt(text=prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 1 << 31 for t in prompt):
        return common_pb2.Prompt(tokens=common_pb2.TokenIds(ids=prompt))
    raise BadField("prompt", "prompt must be a string or a list of token ids (one prompt per request)")


def _number(body: dict, name: str, kind: type, default: float | None, low: float, high: float):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if kind is int else int | float):
        raise BadField(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not low <= value <= high:
        raise BadField(name, f"{name} must be in [{low}, {high}], got {value}")
    return kind(value)


def _dspark_options(options: object, request: target_pb2.GenerateRequest) -> None:
    """The `dspark` extension: mode, proposal, proposer, kernel (names as the SDK spells them), budget, ignore_eos."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise BadField("dspark", "dspark must be an object, e.g. {\"mode\": \"ar\"}")
    unknown = set(options) - {*DSPARK_CHOICES, "budget", "ignore_eos"}
    if unknown:
        raise BadField("dspark", f"unknown dspark option(s) {', '.join(sorted(unknown))}; known: "
                       f"{', '.join([*DSPARK_CHOICES, 'budget', 'ignore_eos'])}")
    for name, names in DSPARK_CHOICES.items():
        value = options.get(name)
        if value is not None:
            if not isinstance(value, str) or not value or value not in names:
                raise BadField(f"dspark.{name}", f"dspark.{name} must be one of {', '.join(n for n in names if n)}, "
                               f"got {value!r}")
            setattr(request, name, names[value])
    request.budget = _number(options, "budget", int, 0, 0, INT32_MAX)
    ignore_eos = options.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadField("dspark.ignore_eos", "dspark.ignore_eos must be true or false")
    request.ignore_eos = ignore_eos


# -- replies -> OpenAI JSON ----------------------------------------------------------------------------


def stats_extension(stats: common_pb2.GenerationStats, token_ids: list[int]) -> dict:
    """The response's `dspark` object: the stats as `dspark generate --json` prints them (stats_dict) and the ids of
    the completion's tokens."""
    out = stats_dict(stats)
    out["token_ids"] = token_ids
    return out


def usage(stats: common_pb2.GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(e: ServiceError) -> web.Response:
    status = HTTP_STATUS.get(e.status, 500)
    code = "invalid_api_key" if status == 401 else e.status.name.lower()
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response(error_body(status, e.message, getattr(e, "param", None), code), status=status,
                             headers=headers)


# -- the server --------------------------------------------------------------------------------------


class HttpFront:
    """The HTTP API of one TargetServicer; a serving/server.py Companion (started once the gRPC port listens,
    drained with it). `tokens`: the gRPC port's bearer tokens (the same check, `Authorization: Bearer TOKEN`);
    `ssl_context`: HTTPS (from the gRPC port's --tls-cert/--tls-key)."""

    def __init__(self, servicer: TargetServicer, host: str, port: int, tokens: frozenset[str] = frozenset(),
                 ssl_context: ssl.SSLContext | None = None, log_prefix: str = "[dspark-target]") -> None:
        self.servicer, self.host, self.port = servicer, host, port
        self.guard = Guard(tokens)
        self.ssl_context = ssl_context
        self.log_prefix = log_prefix
        self.draining = False
        self.created = int(time.time())
        self.tasks = RunningTasks()  # the generation requests under way
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.servicer.max_message_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> None:
        # handler_cancellation: a client that goes away cancels its request, which stops the generation
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        try:
            await site.start()
        except OSError as e:
            raise SystemExit(f"{self.log_prefix} error: cannot listen for HTTP on {self.host}:{self.port}: "
                             f"{e.strerror or e} (choose another --http-port, or 0 for a free one)") from None
        self.port = self._runner.addresses[0][1]  # (--http-port 0: the one picked)
        scheme = "https" if self.ssl_context is not None else "http"
        print(f"{self.log_prefix} OpenAI-compatible HTTP API at {scheme}://{self.host}:{self.port}/v1", flush=True)

    async def drain(self, grace_s: float) -> None:
        """New requests get 503; running ones get `grace_s` to finish, then are cancelled (their sessions freed)."""
        self.draining = True
        if ended := await self.tasks.drain(grace_s):
            print(f"{self.log_prefix} {ended} HTTP request(s) still running at the grace period's end: ended (503)",
                  flush=True)
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            if request.path != "/health" and self.guard.tokens and \
                    not self.guard.authorized([("authorization", request.headers.get("Authorization", ""))]):
                raise Unauthenticated("missing or wrong bearer token: send the header 'Authorization: Bearer TOKEN' "
                                      "with a token of the server's --auth-token-file")
            return await handler(request)
        except ServiceError as e:
            if isinstance(e, BadField | Unauthenticated):  # (the servicer logs the refusals it makes)
                log_refusal(f"HTTP {request.path}", e)
            return error_response(e)
        except web.HTTPException as e:  # aiohttp's own (no such route, body too large): in OpenAI's shape too
            if e.status < 400:
                raise
            return web.json_response(error_body(e.status, e.text or e.reason), status=e.status)

    def _ready(self):
        if self.draining:
            raise Draining("the server is shutting down; retry elsewhere or after it restarts")
        return self.servicer.ready_engine()

    async def _health(self, request: web.Request) -> web.Response:
        self._ready()
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        engine = self._ready()
        return web.json_response({"object": "list", "data": [
            {"id": engine.name, "object": "model", "created": self.created, "owned_by": "dspark-grpc",
             "max_model_len": engine.max_length}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        engine = self._ready()
        try:
            body = await request.json()
        except ValueError as e:
            raise BadField(None, f"the request body is not valid JSON ({e})") from None
        generate, stream, include_usage = generate_request(body, chat)
        task = asyncio.current_task()
        self.tasks.add(task)
        replies = self.servicer.generation_stream(generate, principal_of(_HttpCall(request)), None,
                                                  what=f"HTTP {request.path}")
        try:
            first = await anext(replies)  # a refused request (bad prompt, too many sessions) is an HTTP status
            shape = _Shape(chat, engine.name)
            if stream:
                return await self._stream(request, shape, first, replies, include_usage)
            text, ids, last = [], [], first
            async for reply in _chain(first, replies):
                text.append(reply.text)
                ids.extend(reply.token_ids)
                last = reply
            return web.json_response(shape.completion("".join(text), ids, last))
        except asyncio.CancelledError:
            if (ended := self._ended()) is None:
                raise
            raise ended from None
        finally:
            await replies.aclose()  # cancelled (the client went away) or done: the steps stop, the session is freed
            self.tasks.discard(task)

    def _ended(self) -> Draining | None:
        """For a cancelled request: Draining (answered with 503) when `drain` cancelled it at the grace period's end,
        as the gRPC port answers UNAVAILABLE; None when its client went away (the cancellation goes on)."""
        task = asyncio.current_task()
        if task not in self.tasks.ending:
            return None
        task.uncancel()
        return Draining("the server shut down: its grace period ended before this request did; retry elsewhere or "
                        "after it restarts")

    async def _stream(self, request: web.Request, shape: _Shape, first: target_pb2.GenerateResponse,
                      replies: AsyncIterator[target_pb2.GenerateResponse], include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(data: dict | str) -> None:
            await response.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

        if shape.chat:
            await send(shape.chunk(role=True, usage=include_usage))
        try:
            async for reply in _chain(first, replies):
                if reply.text or reply.token_ids:
                    await send(shape.chunk(reply.text, token_ids=list(reply.token_ids), usage=include_usage))
                if reply.finish_reason:
                    await send(shape.chunk(finish=reply, usage=include_usage))
                    if include_usage:
                        await send({**shape.head(chunk=True), "choices": [], "usage": usage(reply.stats)})
        except asyncio.CancelledError:
            if (ended := self._ended()) is None:
                raise
            await send(error_body(503, ended.message, code="unavailable"))
            return response
        except ServiceError as e:  # the status line has gone: the error is the last event
            await send(error_body(HTTP_STATUS.get(e.status, 500), e.message, code=e.status.name.lower()))
            return response
        await send("[DONE]")
        await response.write_eof()
        return response


class _Shape:
    """OpenAI's objects for one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def completion(self, text: str, token_ids: list[int], last: target_pb2.GenerateResponse) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": FINISH[last.finish_reason]}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return {**self.head(), "choices": [choice], "usage": usage(last.stats),
                "dspark": stats_extension(last.stats, token_ids)}

    def chunk(self, text: str = "", token_ids: list[int] | None = None, role: bool = False,
              finish: target_pb2.GenerateResponse | None = None, usage: bool = False) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": FINISH[finish.finish_reason] if finish else None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text} if not finish \
                else {}
        else:
            choice["text"] = text
        out = {**self.head(chunk=True), "choices": [choice]}
        if usage:
            out["usage"] = None
        if token_ids is not None:
            out["dspark"] = {"token_ids": token_ids}
        elif finish is not None:
            out["dspark"] = stats_extension(finish.stats, [])
            del out["dspark"]["token_ids"]  # (sent with the text chunks)
        return out


async def _chain(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


class _HttpCall:
    """What serving/security.principal_of reads of a gRPC call, of an HTTP request: the same caller is the same
    principal (and counts towards the same session limit) on either port."""

    def __init__(self, request: web.Request) -> None:
        self.request = request

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [("authorization", self.request.headers.get("Authorization", ""))]

    def auth_context(self) -> dict[str, list[bytes]]:
        cert = self.request.transport.get_extra_info("peercert") if self.request.transport else None
        names = [value for rdn in (cert or {}).get("subject", ()) for key, value in rdn if key == "commonName"]
        return {"x509_common_name": [names[0].encode()]} if names else {}

    def peer(self) -> str:
        peer = self.request.transport.get_extra_info("peername") if self.request.transport else None
        if not peer:
            return ""
        host, port = peer[0], peer[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def ssl_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """HTTPS with the gRPC port's certificate and key; client certificates required when `client_ca` is given."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
